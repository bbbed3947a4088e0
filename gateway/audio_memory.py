"""What the gateway remembers of its spoken answers, for OpenAI's multi-turn audio: a later chat may send the
assistant's earlier turn as `{"role": "assistant", "audio": {"id": "audio_..."}}` instead of its text.

Data flow: a chat completion with audio out -> `remember(audio id, transcript)` (the whole answer's, or at the
stream's end) -> the answer's `message.audio.expires_at` says until when -> a later request's assistant
message with that `audio.id` -> `transcript(id)` becomes the message's text (the thinker reads assistant
turns as text; the talker speaks only the new answer). An id this gateway never gave, or one past its
time, is a 400 naming the field: the client can send the transcript as the message's content instead.

Kept in this process only (at most `MAX_ENTRIES`, the oldest dropped first, each for `TTL_S`): with several
gateways behind a balancer, send a conversation's turns to one gateway or send the transcripts. Only the
text is kept, never the audio.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

TTL_S = 3600  # OpenAI keeps a response's audio for multi-turn use for an hour
MAX_ENTRIES = 65536  # transcripts kept at once (a few MB of text at most)


class AudioMemory:
    def __init__(self, ttl_s: float = TTL_S, max_entries: int = MAX_ENTRIES) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: OrderedDict[str, tuple[str, float]] = OrderedDict()  # id -> (transcript, expiry, wall s)
        self._lock = threading.Lock()

    def remember(self, audio_id: str, transcript: str) -> int:
        """Keep `transcript` under `audio_id`; returns its expiry as a Unix time (OpenAI's `expires_at`)."""
        expires = time.time() + self.ttl_s
        with self._lock:
            self._entries[audio_id] = (transcript, expires)
            self._entries.move_to_end(audio_id)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return int(expires)

    def expiry(self) -> int:
        """What `remember` now would return (for an id whose transcript comes at the stream's end)."""
        return int(time.time() + self.ttl_s)

    def transcript(self, audio_id: str) -> str | None:
        """The transcript of a spoken answer still remembered, else None (never given, or expired)."""
        with self._lock:
            entry = self._entries.get(audio_id)
            if entry is None:
                return None
            if entry[1] < time.time():
                del self._entries[audio_id]
                return None
            return entry[0]
