"""The scheduler side's bookkeeping: which blocks each step loads from and saves to the pool.

Pure Python on plain numbers, so it is tested without an engine. The connector feeds it
what vLLM's scheduler says (a lookup's hit, the blocks allocated, the tokens scheduled) and
ships the ``StepPlan`` it builds to the workers, which move the bytes.

A prompt's full blocks go to the pool under vLLM's block hashes; its partial last block, the
*tail*, under a key of its own (``kvstore_client.vllm_hashing.tail_hash``), saved once the
prompt is computed. A lookup that finds every full block and the tail lets vLLM compute only
the prompt's last token.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BlockTransfer:
    """Blocks of one request to move this step: vLLM block ids, their hashes, and the index of
    the first one in the request's chain (its depth, for the pool's length-aware eviction)."""

    req_id: str
    block_ids: list[int]
    hashes: list[bytes]
    first_index: int


@dataclass
class StepPlan:
    """What the workers load before (layer by layer, as attention needs it) and save after
    each layer's attention in one engine step."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


@dataclass
class RequestState:
    """One running request as the connector sees it."""

    hashes: list[bytes]  # vLLM's block hashes, a live list that grows as tokens are added
    prompt_len: int
    tail: bytes | None = None  # the key of the prompt's partial last block, if the pool keeps it
    block_ids: list[int] = field(default_factory=list)
    pool_hit: int = 0  # leading blocks the pool held at lookup (the tail counts as one past the full ones)
    saved: int = 0  # leading full blocks known to be in the pool (found there, or sent)
    tail_saved: bool = False  # the tail is known to be in the pool
    pending_load: tuple[int, int] | None = None  # (first, last + 1) block index to load next step
    save: bool = True  # False when the pool could not be asked about it: nothing of it is saved


class RequestPlans:
    """Per-request state from lookup to finish, and the plan of each step."""

    def __init__(self, block_size: int, *, load: bool, save: bool, save_decode: bool):
        self.block_size = block_size
        self.load, self.save, self.save_decode = load, save, save_decode
        # lookups not yet allocated: (pool blocks, local tokens, tail key, whether to save it)
        self._hits: dict[str, tuple[int, int, bytes | None, bool]] = {}
        self._requests: dict[str, RequestState] = {}

    # -- lookup and allocation -------------------------------------------------------------
    def full_blocks(self, num_prompt_tokens: int) -> int:
        """The prompt's full blocks: the ones with a vLLM hash."""
        return num_prompt_tokens // self.block_size

    def remember_hit(
        self,
        req_id: str,
        pool_blocks: int,
        num_computed_tokens: int,
        tail: bytes | None = None,
        reachable: bool = True,
    ) -> None:
        """A lookup's result: the pool's leading blocks (``full_blocks + 1`` when it held the
        tail too), vLLM's own hit then (tokens), and the tail's key (None: no tail).
        ``reachable`` False: the pool could not be asked (a master that hangs, or is gone), so
        nothing of this request is saved either: a save would wait on that master too."""
        self._hits[req_id] = (pool_blocks, num_computed_tokens, tail, reachable)

    def external_tokens(self, pool_blocks: int, num_computed_tokens: int, num_prompt_tokens: int) -> int:
        """Tokens beyond vLLM's local hit that the pool can supply (0 when loading is off).

        vLLM must compute at least the prompt's last token: a prompt whose blocks are all in
        the pool (its tail too, if it has one) loads every block and vLLM computes that one
        token again (its KV slot gets the same bytes), rather than recomputing the whole
        last block."""
        if not self.load:
            return 0
        return max(min(pool_blocks * self.block_size, num_prompt_tokens - 1) - num_computed_tokens, 0)

    def allocated(self, req_id: str, hashes: list[bytes], prompt_len: int, num_external_tokens: int) -> None:
        """vLLM allocated blocks for a request (new, or resumed after preemption): load
        ``num_external_tokens`` past its local hit next step."""
        pool_hit, num_computed_tokens, tail, reachable = self._hits.pop(req_id, (0, 0, None, True))
        state = self._requests.get(req_id)
        if state is None:
            state = self._requests[req_id] = RequestState(hashes, prompt_len, save=reachable)
        state.tail = tail or state.tail
        full = self.full_blocks(prompt_len)
        state.pool_hit = max(state.pool_hit, pool_hit)
        state.saved = max(state.saved, min(pool_hit, full))
        state.tail_saved = state.tail_saved or pool_hit > full
        state.pending_load = None
        if num_external_tokens > 0:
            first = num_computed_tokens // self.block_size
            end = -(
                -(num_computed_tokens + num_external_tokens) // self.block_size
            )  # a block partly needed loads whole
            state.pending_load = (first, end)

    # -- each step ---------------------------------------------------------------------------
    def step(
        self,
        new: list[tuple[str, list[int], int]],
        cached: list[tuple[str, list[int] | None, bool, int]],
        scheduled: dict[str, int],
        speculative: dict[str, int] | None = None,
    ) -> StepPlan:
        """The plan of one step.

        ``new``: (req_id, block ids, num_computed_tokens) of newly scheduled requests;
        ``cached``: (req_id, new block ids or None, resumed from preemption, num_computed_tokens);
        ``scheduled``: tokens scheduled per request; ``speculative``: draft tokens among them
        (their KV may be rejected, so they never complete a block that is saved).
        """
        plan = StepPlan()
        speculative = speculative or {}
        for req_id, block_ids, computed in new:
            state = self._requests.get(req_id)
            if state is not None:
                state.block_ids = list(block_ids)
                self._plan(plan, req_id, state, computed + scheduled.get(req_id, 0) - speculative.get(req_id, 0))
        for req_id, new_block_ids, resumed, computed in cached:
            state = self._requests.get(req_id)
            if state is None:
                continue
            if resumed:
                state.block_ids = list(new_block_ids or [])
            elif new_block_ids:
                state.block_ids.extend(new_block_ids)
            self._plan(plan, req_id, state, computed + scheduled.get(req_id, 0) - speculative.get(req_id, 0))
        return plan

    def _plan(self, plan: StepPlan, req_id: str, state: RequestState, computed_after: int) -> None:
        if state.pending_load is not None:
            first, end = state.pending_load
            plan.loads.append(self._load(req_id, state, first, end))
            state.pending_load = None
        if not (self.save and state.save):
            return
        limit = computed_after if self.save_decode else min(computed_after, state.prompt_len)
        full = min(limit // self.block_size, len(state.hashes), len(state.block_ids))
        if full > state.saved:
            plan.saves.append(self._transfer(req_id, state, state.saved, full))
            state.saved = full
        self._save_tail(plan, req_id, state, computed_after)

    def _save_tail(self, plan: StepPlan, req_id: str, state: RequestState, computed_after: int) -> None:
        """Save the tail's block under the tail's key, once, in the step that computes the
        prompt's last token. Decode tokens that later fill the block do not touch the
        tail's slots; with ``save_decode`` the full block is saved under its own hash too."""
        index = self.full_blocks(state.prompt_len)
        if state.tail is None or state.tail_saved or computed_after < state.prompt_len:
            return
        if len(state.block_ids) > index:
            plan.saves.append(BlockTransfer(req_id, [state.block_ids[index]], [state.tail], index))
            state.tail_saved = True

    def _load(self, req_id: str, state: RequestState, first: int, end: int) -> BlockTransfer:
        """Prompt blocks ``first`` to ``end - 1`` to load: past the full ones, the tail."""
        full = self.full_blocks(state.prompt_len)
        hashes = [bytes(h) for h in state.hashes[first : min(end, full)]]
        if end > full:  # only a lookup that found the tail loads past the full blocks
            assert state.tail is not None
            hashes.append(state.tail)
        return BlockTransfer(req_id, state.block_ids[first:end], hashes, first)

    @staticmethod
    def _transfer(req_id: str, state: RequestState, first: int, end: int) -> BlockTransfer:
        return BlockTransfer(req_id, state.block_ids[first:end], [bytes(h) for h in state.hashes[first:end]], first)

    def finished(self, req_id: str) -> None:
        self._hits.pop(req_id, None)
        self._requests.pop(req_id, None)

    def tracked(self) -> int:
        """Requests with state (for tests: nothing may outlive its request)."""
        return len(self._requests) + len(self._hits)
