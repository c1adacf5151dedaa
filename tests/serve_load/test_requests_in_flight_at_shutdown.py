"""Requests in flight when the engine is shut down end; none waits forever.

`vllm serve` shuts the engine down on SIGTERM while the HTTP server still
accepts work, then waits for every open connection to close. A request that
reached the engine client just as the engine core stopped gets no output from
it: unless the client ends it, its stream stays open and the server never
exits (seen once in the suite: "Waiting for connections to close", still alive
60 s after SIGTERM). The window is a few milliseconds wide, too narrow to hit
on purpose through a real server, so these tests drive AsyncLLM itself with an
engine core that accepts requests and never answers -- exactly what a stopped
engine core is to the client.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

# A request that hangs is the failure; bound each wait well above the
# milliseconds the fixed behaviour takes, so load cannot change the verdict.
HANG_S = 5.0


class _StoppedEngineCore:
    """The client side of an engine core that has stopped: requests are
    accepted and never answered. `on_add` runs after each request is sent."""

    def __init__(self, on_add=None):
        self.resources = SimpleNamespace(engine_dead=False)
        self.on_add = on_add
        self.added: list[str] = []

    async def get_output_async(self):
        await asyncio.Event().wait()

    async def add_request_async(self, request) -> None:
        self.added.append(request.request_id)
        if self.on_add is not None:
            await self.on_add()

    async def abort_requests_async(self, request_ids) -> None:
        pass

    def shutdown(self, timeout=None) -> None:
        pass


def _async_llm(engine_core):
    """An AsyncLLM with only what generate() and shutdown() use (no engine,
    no model, no renderer)."""
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.engine.output_processor import OutputProcessor

    llm = object.__new__(AsyncLLM)
    llm.engine_core = engine_core
    llm.output_processor = OutputProcessor(None, log_stats=False)
    llm.input_processor = SimpleNamespace(assign_request_id=InputProcessor.assign_request_id)
    llm.vllm_config = SimpleNamespace(cache_config=SimpleNamespace(kv_sharing_fast_prefill=False))
    llm.output_handler = None
    llm.log_stats = False
    llm.log_requests = False
    llm.logger_manager = None
    llm.renderer = None
    return llm


def _request(request_id: str, n: int = 1):
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    params = SamplingParams(max_tokens=8, n=n, detokenize=False, output_kind=RequestOutputKind.DELTA)
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=[1, 2, 3],
        mm_features=None,
        sampling_params=params,
        pooling_params=None,
        arrival_time=time.time(),
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
    )


async def _collect(llm, request):
    return [out async for out in llm.generate(request, request.sampling_params, request.request_id)]


async def _request_sent_to_the_engine(llm, request_id: str) -> asyncio.Future:
    """Start generate() for a request and return once the engine core has it."""
    task = asyncio.ensure_future(_collect(llm, _request(request_id)))
    while not llm.engine_core.added:
        await asyncio.sleep(0.01)
    return task


def _shutdown_from_another_thread(llm) -> None:
    """As the API server does: AsyncLLM.shutdown runs in an executor thread."""
    t = threading.Thread(target=llm.shutdown)
    t.start()
    t.join(HANG_S)
    assert not t.is_alive(), "AsyncLLM.shutdown() did not return"


@pytest.mark.needs_patch("0014")
def test_request_waiting_for_output_is_aborted_when_the_engine_shuts_down():
    llm = _async_llm(_StoppedEngineCore())

    async def scenario():
        task = await _request_sent_to_the_engine(llm, "waiting")
        await asyncio.get_running_loop().run_in_executor(None, _shutdown_from_another_thread, llm)
        done, _ = await asyncio.wait({task}, timeout=HANG_S)
        assert done, (
            f"a request in flight at shutdown still waits for output {HANG_S:.0f} s "
            "later (its HTTP stream would keep `vllm serve` from exiting)"
        )
        return task.result()

    outputs = asyncio.run(scenario())
    assert outputs, "the request ended without a final output"
    final = outputs[-1]
    assert final.finished
    assert [c.finish_reason for c in final.outputs] == ["abort"], final


@pytest.mark.needs_patch("0014")
def test_child_request_added_after_the_engine_shut_down_fails_at_once():
    """n=2: the engine stops while the first child is being sent; the second
    must not be registered for outputs that will never come."""
    from vllm.v1.engine.exceptions import EngineDeadError

    llm = None

    async def stop_engine_after_first_child():
        if len(llm.engine_core.added) == 1:
            llm.output_handler.cancel()
            await asyncio.sleep(0)

    llm = _async_llm(_StoppedEngineCore(on_add=stop_engine_after_first_child))

    async def scenario():
        task = asyncio.ensure_future(_collect(llm, _request("parallel", n=2)))
        done, _ = await asyncio.wait({task}, timeout=HANG_S)
        assert done, f"an n=2 request whose engine stopped between its children still waits {HANG_S:.0f} s later"
        return task

    task = asyncio.run(scenario())
    with pytest.raises(EngineDeadError):
        task.result()
    assert len(llm.engine_core.added) == 1, llm.engine_core.added


def test_request_after_shutdown_fails_at_once():
    """Unpatched behaviour kept: once shut down, a new request is refused."""
    from vllm.v1.engine.exceptions import EngineDeadError

    llm = _async_llm(_StoppedEngineCore())

    async def scenario():
        first = await _request_sent_to_the_engine(llm, "first")
        llm.output_handler.cancel()
        await asyncio.wait({first}, timeout=HANG_S)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(_collect(llm, _request("late")), HANG_S)
        first.cancel()

    asyncio.run(scenario())
