"""The destination side of a rank: fetches and their parts (one class per way a payload
travels through staging, and one for zero copy: DIRECT runs and head slices), offers received,
READ (pull) or grants (push), unpack, acks, and each fetch's finish or failure.
:class:`Destination` composes them."""

from .core import Destination
from .fetch import Fetch
from .fetches import Fetches, RequestResult
from .offers import MAX_OFFERS_PER_PEER, Offers
from .parts import (
                    DirectPart,
                    GrantedPart,
                    PackPlacePart,
                    Part,
                    PayloadPart,
                    ReadUnpackPart,
                    StagedPart,
)

__all__ = ["Destination", "Fetch", "Fetches", "RequestResult", "Offers", "MAX_OFFERS_PER_PEER", "Part",
           "PayloadPart", "DirectPart", "StagedPart", "PackPlacePart", "ReadUnpackPart",
           "GrantedPart"]
