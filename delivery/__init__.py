"""Model delivery: `dlo fetch URI DEST`, run by hand, by `dlo serve URI` and by the node
fetch Jobs the operator creates (docs/operator.md, "Model delivery").

Owns: model URIs and their cache keys (`uri`, stdlib only: the operator imports it), a verified,
resumable, atomically published download of a diffusers pipeline folder from S3 (boto3) or the
Hugging Face Hub (huggingface_hub), the node cache's eviction, and the `dlo fetch` command.
Must never: import torch (the fetch runs in slim Jobs and beside the operator), read a credential
from anywhere but the environment the SDKs read, or leave a partial folder at DEST.
"""
