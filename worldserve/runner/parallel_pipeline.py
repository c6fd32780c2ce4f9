"""`ParallelPipeline`: rank 0's VideoBackend when several GPUs share each request (runner/parallel_layout.py):
`--cfg-parallel-size 2` (the uncond branch on its own GPUs) and/or `--ulysses-degree U` (every forward split
over U GPUs by tokens, parallel/ulysses.py). The peers are spawned processes (runner/parallel_worker.py),
each holding the full model on cuda:r (gloo CPU ranks with --device cpu, for tests).

Rank 0 wraps a local VideoPipeline that does everything one process does (prompts, noise, conditioning,
CFG combine in float32, UniPC, decode; the Reasoner shares its und tower); its forwards run with the cond
group's Ulysses group. Messages (small pickled tuples + tensors, runner/peers.py):
- prepare: rank 0 prepares (a bad input fails before any peer hears of it, a LoRA adapter is loaded here
  first), then ("prefill", request_id, cond ids, uncond ids or None, the LoraRequest or None: each peer
  loads its own slices of the adapter) to the cond group's peers, and to the uncond group for CFG requests; with
  cfg == 2 rank 0 keeps only the cond cache;
- denoise: ("denoise", plan) + the requests' latents (+ sound) to the cond group's peers (all requests) and
  to the uncond group (CFG requests only), rank 0's own forward over the cond (and guidance-1) items, then
  the uncond velocities from the uncond group's first rank, and the CFG combine / UniPC step with
  VideoPipeline's code (the same numbers as one process);
- release: ("release", request_id) to the ranks that hold it; close: ("stop",).
A dead peer raises, never a hang. Any failure in the middle of an exchange (a dead peer, or rank 0's own
forward failing while the peers wait in theirs or on a send to it) leaves ranks out of step: the peers are
killed and `BackendLost` raised, which stops the engine with its jobs queued for a restart.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from worldserve.closeable import Closeable
from worldserve.engine.outputs import BackendLost
from worldserve.models.cosmos3.config import Cosmos3Config
from worldserve.models.layers.compile_limits import limits_in_this_thread
from worldserve.parallel.comm import PeerError
from worldserve.parallel.ulysses import check_degree
from worldserve.params import ParamError, VideoParams
from worldserve.runner.devices import default_dtype, rank_devices
from worldserve.runner.kernel_options import KernelOptions
from worldserve.runner.lora_cache import DEFAULT_MAX_LOADED
from worldserve.runner.parallel_layout import ParallelLayout
from worldserve.runner.parallel_worker import BranchRank
from worldserve.runner.peer_start import PeerLink
from worldserve.runner.peers import PeerRanks, peer_worker_main, send_step
from worldserve.runner.video_pipeline import VideoPipeline
from worldserve.runner.video_state import VideoRequestState, branch_items, guided, step_caches, step_lora
from worldserve.sampling.guidance import needs_uncond
from worldserve.weights.checkpoint import read_transformer_config, resolve_model

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from worldserve.engine.outputs import VideoResult
    from worldserve.models.cosmos3.prompt import PromptEncoder
    from worldserve.models.cosmos3.transformer import Cosmos3Transformer
    from worldserve.params import LoraRequest
    from worldserve.runner.lora_cache import LoraCache

log = logging.getLogger("worldserve.parallel")
PEER_EXIT_WAIT_S = 1.0
"""How long a failed exchange waits for a dying peer to be reaped, to name it as the cause."""


def check_checkpoint_layout(config: Cosmos3Config, *, ulysses: int = 1, tp: int = 1) -> None:
    """ValueError naming the flag unless a transformer of `config` splits over `ulysses` / `tp` ranks: both
    divide its query and KV head counts, `tp` its MLP width (each rank owns whole heads and 1 / tp of every
    MLP's hidden units). Serve runs it before the model loads."""
    for degree, flag in ((ulysses, "--ulysses-degree"), (tp, "--tensor-parallel-size")):
        check_degree(degree, heads=config.num_attention_heads, kv_heads=config.num_key_value_heads, flag=flag)
    if config.intermediate_size % tp:
        raise ValueError(
            f"--tensor-parallel-size {tp} must divide intermediate_size={config.intermediate_size}"
        )


class ParallelPipeline(Closeable):
    """VideoBackend on rank 0 of C x U ranks."""

    def __init__(self, local: VideoPipeline, peers: PeerRanks, layout: ParallelLayout):
        self.local, self.peers, self.layout = local, peers, layout
        self._cfg_remote: set[str] = set()  # requests whose uncond branch runs on the uncond group
        self._lock = peers.lock  # one conversation with the peers at a time
        self._cond_peers = list(range(1, layout.per_branch))
        self._uncond_peers = list(range(layout.per_branch, layout.world)) if layout.cfg == 2 else []
        self._abandoned: str | None = None  # why abandon_step killed the peers

    @classmethod
    def from_pretrained(
        cls, path: str | Path | None, layout: ParallelLayout, device: str | torch.device | None = None,
        dtype: torch.dtype | None = None, kernels: KernelOptions | None = None, *, revision: str | None = None,
        max_loras: int = DEFAULT_MAX_LOADED, max_lora_rank: int | None = None, **kwargs: Any,
    ) -> ParallelPipeline:  # fmt: skip
        """Check the layout against the checkpoint, spawn the peers, join the world with them, load the full
        pipeline here while each peer loads the transformer on its GPU, and wait for every peer's "ready"
        (runner/peers.py). A peer that dies meanwhile: PeerError, one line naming the layout, rank, exit code.
        `path` / `revision` as VideoPipeline.from_pretrained's (weights/checkpoint.py resolve_model), resolved
        once here: every rank loads that folder. `max_loras` / `max_lora_rank` (--max-cpu-loras /
        --max-lora-rank) make every rank's LoRA cache: rank 0's and each peer's take the same bound."""
        root = resolve_model(None if path is None else str(path), revision)
        config = read_transformer_config(root)
        check_checkpoint_layout(config, ulysses=layout.ulysses, tp=layout.tp)
        devices = rank_devices(device, layout.world, layout.flags)
        if dtype is None:
            dtype = default_dtype(devices[0])
        kernels = kernels or KernelOptions()

        def peer_args(r: int, link: PeerLink) -> tuple:
            branch = functools.partial(
                BranchRank, layout=layout, rank=r, max_loras=max_loras, max_lora_rank=max_lora_rank
            )
            return (
                r,
                link,
                layout.world,
                str(root),
                str(devices[r]),
                dtype,
                kernels,
                branch,
                "parallel",
                layout.tp_group(r) if layout.tp > 1 else None,
            )

        def load_local() -> VideoPipeline:
            sp = layout.branch_group(0)  # collective: with the peers' own calls, before any rank loads
            local = VideoPipeline.from_pretrained(
                root, device=devices[0], dtype=dtype, kernels=kernels, tp=layout.tp_group(0), max_loras=max_loras,
                max_lora_rank=max_lora_rank, **kwargs,
            )  # fmt: skip
            local.sp = sp
            return local

        try:
            peers, local = PeerRanks.start("parallel", peer_worker_main, peer_args, devices, load_local)
        except PeerError as exc:
            raise PeerError(f"{layout.flags}: {exc}") from exc
        log.info("%s on %s", layout.flags, ", ".join(map(str, devices)))
        return cls(local, peers, layout)

    # ------------------------------------------------------------------ VideoBackend
    @property
    def process(self) -> BaseProcess:
        """The rank 1 process."""
        return self.peers.processes[0]

    @property
    def has_sound(self) -> bool:
        return self.local.has_sound

    @property
    def loras(self) -> LoraCache:
        """Rank 0's LoRA adapters (each peer loads its own slices of the ones its requests name)."""
        return self.local.loras

    @property
    def transformer(self) -> Cosmos3Transformer:
        """Rank 0's transformer (the Reasoner shares its und tower)."""
        return self.local.transformer

    @property
    def encoder(self) -> PromptEncoder:
        return self.local.encoder

    @property
    def device(self) -> torch.device:
        return self.local.device

    def problem(self) -> str | None:
        """Why the peers cannot serve (one exited, or they were stopped after an error), None while they can:
        /health says it at once, not only once a request has failed on it."""
        if self.peers.closed:
            return f"{self.layout.flags}: the peer ranks are stopped"
        return self.peers.gone(public=True)

    def prepare_thread(self) -> None:
        """As VideoPipeline.prepare_thread (compile_limits.limits_in_this_thread)."""
        limits_in_this_thread()

    def validate(self, params: VideoParams) -> VideoParams:
        return self.local.validate(params)

    def sound_enabled(self, params: VideoParams) -> bool:
        return self.local.sound_enabled(params)

    def decode(self, state: VideoRequestState, *, stream: bool = False) -> VideoResult:
        return self.local.decode(state, stream=stream)

    def free_cached_memory(self) -> None:
        """Rank 0's cached device blocks (a failed forward on the peers is a BackendLost: no retries there)."""
        self.local.free_cached_memory()

    generate = VideoPipeline.generate  # validate -> prepare -> denoise... -> decode, through this class

    @contextmanager
    def _exchange(self) -> Iterator[None]:
        """The lock over one exchange with the peers. A failure inside it leaves them out of step with rank 0
        (or dead): they are killed and BackendLost raised, rather than the next exchange hanging on them."""
        with self._lock:
            try:
                yield
            except ParamError:  # a bad input, answered with the peers still in step (prepare)
                raise
            except Exception as exc:
                # (a dead peer is the cause: its own log says why, no traceback here; anything else is a
                # failure of this rank's, with it; abandon_step's kill: the shutdown's reason)
                gone = self._abandoned or self.peers.gone(PEER_EXIT_WAIT_S)
                told = self._abandoned or self.peers.gone(public=True)
                log.error(
                    "%s: failed inside an exchange with the peer ranks%s", self.layout.flags,
                    f" ({gone})" if gone else "", exc_info=None if gone else exc,
                )  # fmt: skip
                self.peers.kill()
                lost = f"{self.layout.flags}: the peer ranks are stopped after an error"
                # (clients and /health hear which peer went, as /health says of one gone while idle; another
                # error's text stays in the log)
                public = f"{lost}: {told}" if told else f"{lost} (the server log says which)"
                raise BackendLost(f"{lost}: {gone or exc}", f"{public}. Restart the server") from exc
            except (
                BaseException
            ):  # Ctrl-C mid-exchange: the peers are out of step; close() would wait on them
                self.peers.kill()
                raise

    def prepare(self, request_id: str, params: VideoParams) -> VideoRequestState:
        cfg = needs_uncond(params.guidance_scale)
        cond, uncond = self.local.encoder.encode_params(params, with_uncond=cfg)
        remote = cfg and self.layout.cfg == 2
        # the adapter loaded here first (a bad one fails before a peer hears of it) and handed to the prepare
        # below (no second read of its files); each peer then loads its own slices and answers (merged into a
        # rank's weights, it takes what stays unmerged there: the und deltas, any row left out, or none)
        held = self.local.loras.get(params.lora)
        merged = self.local.transformer.merged_lora is not None
        lora = params.lora if held is not None or merged else None
        msg = ("prefill", request_id, list(cond), None if uncond is None else list(uncond), lora)
        to = self._cond_peers + (self._uncond_peers if remote else [])
        asked = lora is not None and bool(to)
        if asked and lora is not None:  # (identity None: merged here, the peers take their own merge's rest)
            self._peers_load_lora(request_id, lora, None if merged or held is None else held.key[0], to)
        if self.layout.tp > 1:  # the prefill is collective: the peers must run it alongside rank 0
            with self._exchange():
                self.peers.send(msg, to)
                try:
                    state = self.local.prepare(request_id, params, prompt_ids=(cond, uncond), adapter=held)
                except ParamError:  # a bad input (after the collective prefill): the request alone fails
                    self.peers.send(("release", request_id), to)
                    raise
        else:  # rank 0 first: a bad input fails before any peer hears of its prefill
            try:
                state = self.local.prepare(
                    request_id, params, prefill_uncond=not remote, prompt_ids=(cond, uncond), adapter=held
                )
            except BaseException:
                if asked:  # (the peers hold the adapter for it)
                    with self._exchange():
                        self.peers.send(("release", request_id), to)
                raise
            with self._exchange():
                self.peers.send(msg, to)
        if remote:
            self._cfg_remote.add(request_id)
        return state

    def _peers_load_lora(
        self, request_id: str, lora: LoraRequest, identity: tuple | None, to: list[int]
    ) -> None:
        """The peers `to` load the request's adapter before its prefill, each answering: one that could not (its
        files gone, or changed since rank 0 read them: `identity`) fails this request alone, a 400 naming
        `lora`, with the peers still in step; rank 0 and the peers then run the files rank 0 read."""
        with self._exchange():
            self.peers.send(("lora", request_id, lora, identity), to)
            refused = [answer for r in to if (answer := self.peers.recv_object(r)) is not None]
            if refused:
                self.peers.send(("release", request_id), to)
                raise ParamError("lora", refused[0])

    @torch.inference_mode()
    def denoise(self, states: Sequence[VideoRequestState]) -> None:
        t0 = time.perf_counter()
        remote = [s for s in states if s.request_id in self._cfg_remote and guided(s)]
        with self._exchange():
            if self._cond_peers:
                send_step(self.peers, states, self._cond_peers)
            if remote:
                send_step(self.peers, remote, self._uncond_peers)
            items = [it for s in states for it in branch_items(s, step_caches(s))]
            out = self.local.forward(items, step_lora(states))
            uncond = {s.request_id: self._recv_uncond(s) for s in remote}
        self.local.apply_step(states, out, t0, uncond)

    def _recv_uncond(self, s: VideoRequestState) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The uncond group's velocities of one CFG request (video, then sound), in the model dtype."""
        dt, dev, src = self.local.transformer.dtype, self.peers.comm_device, self.layout.uncond_leader
        v = self.peers.recv_tensor(torch.empty(s.latents.shape, dtype=dt, device=dev), src)
        vs = None
        if s.sound is not None:
            vs = self.peers.recv_tensor(torch.empty(s.sound.shape, dtype=dt, device=dev), src)
        return v, vs

    def release(self, state: VideoRequestState) -> None:
        self.local.release(state)
        with self._lock:
            holders = self._cond_peers + (self._uncond_peers if state.request_id in self._cfg_remote else [])
            self._cfg_remote.discard(state.request_id)
            if holders and not self.peers.closed and self.peers.alive():
                self.peers.send(("release", state.request_id), holders)

    def abandon_step(self) -> None:
        """The engine's shutdown, past its deadline with a step still running (a peer hung: stopped, or stuck
        in its GPU): kill the peers, without the lock that exchange holds, so that it fails now (BackendLost,
        its job queued again) instead of after the collectives' timeout. The exchange tears the group down."""
        self._abandoned = "the peer ranks were killed at the shutdown (a step had hung)"
        for p in self.peers.processes:
            p.kill()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the peers and tear the process group down (runner/peers.py). Idempotent: a second call, or
        one after the peers were killed, does nothing."""
        with self._lock:
            self.peers.close(timeout_s)
