"""Model delivery: `dlo fetch URI DEST`, run by hand, by `dlo serve URI` and by the node
fetch Jobs the operator creates (docs/operator.md, "Model delivery").

Owns: model URIs and their cache keys (`uri`, stdlib only: the operator imports it), a verified,
resumable, atomically published download of a diffusers pipeline folder (or of a folder of LoRA
adapters: `adapters`) from S3 (boto3) or the Hugging Face Hub (huggingface_hub), the node cache's
eviction, and the `dlo fetch` command; the
one mapping of a name from outside to a path under a root (`paths`) and the marked folders a dlo
command made for itself (`owned`).
Must never: import torch (the fetch runs in slim Jobs and beside the operator), read a credential
from anywhere but the environment the SDKs read, leave a partial folder at DEST, write outside
DEST's folder for a name the source chose, or delete a folder it did not make.
"""
