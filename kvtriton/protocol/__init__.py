"""What two ranks say to each other: :mod:`.wire` (handshake metadata and the control messages
that ride on NIXL notifications: msgpack, versioned, every field validated) and :mod:`.handshake`
(the TCP side channel that carries the metadata before NIXL can carry anything); :mod:`.seal`
proves who sent a multipart control message on a socket anyone may reach (the SGLang backend's).

Import the module you need (``from kvtriton.protocol import wire``); this package imports
none of them, so that reading one costs nothing of the others.
"""
