"""dlo.agent: the node agent (memory truth, page-cache warmer, topology, policy, exporter).

Never imports torch or `dlo.engine`: model folders are read through `dlo.plan.folder`, page-cache residency
through `dlo.pagecache`.
"""
