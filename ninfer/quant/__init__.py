"""Weight formats: reference encoders/decoders and the packing of their stored planes.
`get_format(name)` looks one up; importing this package registers every built-in format."""

from ninfer.quant import fp8, groupwise  # noqa: F401  (registration)
from ninfer.quant.formats import (
    EncodedTensor,
    PlaneSpec,
    WeightFormat,
    format_names,
    get_format,
    register_format,
)

__all__ = [
    "EncodedTensor",
    "PlaneSpec",
    "WeightFormat",
    "format_names",
    "get_format",
    "register_format",
]
