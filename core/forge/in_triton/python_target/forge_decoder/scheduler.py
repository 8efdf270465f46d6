"""The engine's admission policy: which waiting sequences its next step admits, and which leave cancelled.

Every step the engine asks ``_check_cancelled`` (every cancel_check_ms: its owners' cancellations, waiting and
running sequences alike) and ``_admit`` (the waiting sequences its prefill takes: the oldest first, as many as
free rows, the prefill budget and a paged cache's blocks allow, unless ``_gathering`` holds them back for more).
"""

from __future__ import annotations

import time

from .sequences import Sequence, Update


#: On a GPU a prefill keeps the device busy about as long as a decoding step whatever its size (H100, SmolLM2
#: shape: 1.23 ms for one 32-token prompt, 1.61 for 16, against 1.06 for a 64-row step), so while sequences run,
#: arrivals are gathered: admitted once len(running) // ADMIT_SHARE are waiting, the oldest has waited
#: ADMIT_WAIT_STEPS decoding steps (a streamed one, whose client watches for the first token: ADMIT_WAIT_S), or
#: nothing runs. Free slots do not cap the count waited for: at c=64 one or two free up per step, and admitting
#: them at once made nearly every prefill one of one or two prompts. H100, SmolLM2 shape, served c=16 / 64:
#: 4 steps gave 9 400 / 23 850 tok/s against 8 670 / 22 160 (8.9 prompts a prefill, prefill share 0.36 → 0.17);
#: 8 steps measured 8 800 / 22 340 in another call. 2 ms against 8 gave a streamed c=16 time to first token p50 of
#: 28 ms against 38 (H200, streamed steps overlapped then).
ADMIT_SHARE = 4
ADMIT_WAIT_S = 0.002
ADMIT_WAIT_STEPS = 4


class Scheduler:
    """The admission side of ``engine.Engine`` (its base class): the engine's queue (``_pending``), running rows
    (``_active``) and decoder (``graphs``) are the engine's."""

    def _check_cancelled(self) -> None:
        now = time.monotonic()
        if now - self._last_cancel_check < self.cancel_check_s:
            return
        self._last_cancel_check = now
        with self._cond:
            waiting = list(self._pending)
        for seq in waiting + self._active:
            if not seq.cancelled:
                try:
                    seq.cancelled = bool(seq.is_cancelled())
                except Exception:  # the owner went away: nobody wants the result
                    seq.cancelled = True
        gone = [s for s in waiting if s.cancelled]
        if gone:
            with self._cond:
                for seq in gone:
                    if seq in self._pending:
                        self._pending.remove(seq)
            for seq in gone:
                self._finish(seq, Update([], [], [], True, "cancelled"))
        if any(s.cancelled for s in self._active):
            self._settle()  # what the step in flight made for them is reported first, as without overlap
            for seq in self._active:
                if seq.cancelled:
                    self._finish(seq, Update([], [], [], True, "cancelled"))
            self._drop_finished()

    def _gathering(self) -> bool:
        """Whether waiting sequences wait for more to join them in one prefill (see ADMIT_SHARE)."""
        if not self.admit_wait_ns or not self._active or not self._pending:
            return False
        if len(self._pending) >= max(1, len(self._active) // ADMIT_SHARE):
            return False
        oldest = self._pending[0]
        if oldest.request.streaming:  # its client waits for the first token
            return time.time_ns() - oldest.arrival_ns < self.admit_wait_ns
        return self.decode_steps - oldest.arrival_step < ADMIT_WAIT_STEPS

    def _need(self, seq: Sequence) -> int:
        """The most tokens ``seq`` can come to hold (what a paged cache promises it at admission)."""
        return min(len(seq.tokens) + seq.request.max_new_tokens, self.limits.max_seq_len)

    def _admit(self) -> list[Sequence]:
        free = self.max_rows - len(self._active)
        admitted: list[Sequence] = []
        needs: list[int] = []  # each admitted sequence's _need, what a paged cache checks and promises
        longest = 0
        if self._gathering():
            return admitted
        with self._cond:
            while self._pending and len(admitted) < free:
                seq = self._pending[0]
                if seq.cancelled:
                    self._pending.popleft()
                    self._finish(seq, Update([], [], [], True, "cancelled"))
                    continue
                width = max(longest, len(seq.tokens))
                if admitted and width * (len(admitted) + 1) > self.max_prefill_tokens:
                    break
                need = self._need(seq)
                room = True if self.graphs is None or not self.graphs.cache.paged else self.graphs.room(needs + [need])
                if room is None:  # more than the whole pool: it would wait forever
                    self._pending.popleft()
                    self._finish(seq, Update([], [], [], True, "error", (
                        f"the request may reach {need} tokens, more than the paged KV cache holds "
                        f"({self.graphs.cache.blocks} blocks of {self.graphs.cache.block} tokens); lower its "
                        "max_tokens, or raise -o kv_cache_free_gpu_mem_fraction")))
                    continue
                if not room:  # blocks free up as running sequences finish
                    break
                longest = width
                needs.append(need)
                admitted.append(self._pending.popleft())
            self._admitting = admitted  # still busy while its prefill runs (see Engine.busy)
        return admitted
