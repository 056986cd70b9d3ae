"""colibri.daemon: the colibrid service (config, boot placement, server, protocol).

Not built yet: see the daemon issue. Nothing here may be imported by ctl except protocol.
"""
