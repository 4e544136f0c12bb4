"""dlo.pagecache: the page-cache readers and warmer shared by the node agent and the server.

Map: `tree` (the files of a model folder), `residency` (how much of each is in the page cache:
cachestat, else mincore), `warm` (read files into the page cache, with progress).

Must never: import torch or any other dlo package but `dlo.cli.args`.
"""
