"""dlo.agent: the node agent (memory truth, page-cache warmer, topology, policy, exporter).

Never imports torch. May import the torch-free `dlo.engine.checkpoint`, `dlo.engine.families` and `dlo.engine.blocks`.
"""
