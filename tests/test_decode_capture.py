"""The Reasoner's decode-step CUDA graphs are captured while another thread of the process works on the same
GPU: a multi-GPU pipeline's keep-alive thread (runner/peers.py) pings idle peers from a thread of its own, at
any time, the server's start-up (Reasoner.warm_up -> UndDecoder.capture_all) included. Under CUDA's default
"global" capture mode its calls (comm.send_object's host-to-device copies, NCCL's completion polls) fail with
cudaErrorStreamCaptureUnsupported and invalidate the capture: the warm-up failed, and the keep-alive thread
stopped for good (its peers then timed out after the world's timeout)."""

from __future__ import annotations

import pickle
import threading

import pytest
import torch


def _ping_work(dev: torch.device) -> None:
    """The CUDA work of one keep-alive ping on rank 0 (comm.send_object's two tensors, then a completion poll
    as NCCL's work.is_completed makes)."""
    data = torch.frombuffer(bytearray(pickle.dumps(("ping",))), dtype=torch.uint8).to(dev)
    torch.tensor([data.numel()], dtype=torch.int64, device=dev)
    event = torch.cuda.Event()
    event.record()
    event.query()


def _step(decoder) -> torch.Tensor:
    seqs = [decoder.pool.sequence() for _ in range(3)]
    for s in seqs:
        s.reserve(1)
    return decoder.step([7, 8, 9], seqs, [0, 0, 0])


@pytest.mark.gpu
def test_decode_graphs_are_captured_beside_another_threads_cuda_work(tiny_ckpt):
    from worldserve.runner.und_decoder import UndDecoder
    from worldserve.weights.loader import load_transformer

    dev = torch.device("cuda")
    model = load_transformer(tiny_ckpt, dtype=torch.float32, device=dev, progress=False)

    def decoder(**kw) -> UndDecoder:
        return UndDecoder(
            model, model.new_paged_pool(4096, block_size=16), max_batch=32, max_model_len=512, **kw
        )

    want = _step(decoder(enforce_eager=True))
    _step(decoder())  # the step's math compiled before the pings start (the captures then take milliseconds)
    stop, errors, pings = threading.Event(), [], [0]

    def pinger() -> None:
        while not stop.is_set():
            try:
                _ping_work(dev)
            except Exception as exc:  # reported by the test
                errors.append(exc)
                return
            pings[0] += 1

    thread = threading.Thread(target=pinger, daemon=True)
    thread.start()
    graphed = []
    try:
        for _ in range(5):  # six buckets captured each time, the pings running throughout
            graphed.append(decoder())
            graphed[-1].capture_all()
    finally:
        stop.set()
        thread.join(10)
    assert not errors, errors[0]
    assert pings[0] > 0
    for d in graphed:  # the graphs captured beside the pings compute the eager step
        torch.testing.assert_close(_step(d), want, rtol=1e-3, atol=1e-3)
