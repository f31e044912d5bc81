"""Pack attention maps compactly for the browser (the maps are computed on the model's side:
model/analysis/attention_maps.py).

The wire format itself (json, f16, u8; packing full or tril) is attnlens.codec: numpy alone,
so the Python client decodes with the very code the server encodes with. It is re-exported
here (encode, decode, tril_pack, U8_SCALE) for the server's modules and tests.
"""

from __future__ import annotations

from attnlens.codec import U8_SCALE, decode, encode, encode_positions, tril_pack  # noqa: F401  (the server's wire format)

