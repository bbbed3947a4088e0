"""Content digests of a prompt's media items, so the thinker's prefix cache can key the rows they fill.

Role: the thinker's prefix cache keys a prompt row by its token id and positions; a media row's keys and
values depend on the media instead (the encoder's output for it), which the thinker only sees as floats.
The gateway has the decoded media, so it names each item by a 63-bit blake2b digest of what the encoder
will read: the samples / pixels / frames (dtype, shape and bytes) and the processor settings that shape
them (`mm_processor_kwargs` over the server's). Sent to the thinker with the prompt ids as `audio_hashes`
(n_audio,), `image_hashes` (n_images,) and `video_hashes` (n_videos,) int64, in prompt order per modality
(services/llm/prefix_keys.py turns them into row keys).

Data flow: Conversation (audio arrays at 16 kHz, PIL images, sampled video frames) + settings ->
`media_digests` -> {"audio_hashes": (n,), ...} (only the modalities present).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch


def _digest(kind: str, settings: bytes, array: np.ndarray) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(kind.encode() + b"\0" + settings + b"\0" + str(array.dtype).encode() + repr(array.shape).encode())
    h.update(np.ascontiguousarray(array).data)
    return int.from_bytes(h.digest(), "little") >> 1  # fits int64, never negative


def media_digests(audio: list[np.ndarray], images: list[Any], videos: list[np.ndarray],
                  settings: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The digests of each modality's items in prompt order (see the module docstring)."""
    key = repr(sorted(settings.items())).encode()
    out: dict[str, torch.Tensor] = {}
    for name, kind, items in (("audio_hashes", "audio", audio), ("image_hashes", "image", images),
                              ("video_hashes", "video", videos)):
        if items:
            arrays = [np.asarray(x) for x in items]  # a PIL image: its (H, W, C) uint8 pixels
            out[name] = torch.tensor([_digest(kind, key, a) for a in arrays], dtype=torch.int64)
    return out
