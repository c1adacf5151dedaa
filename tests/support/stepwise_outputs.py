"""The output processor driven as the engine drives it, without an engine:
generated token ids reported one per step (no speculation) or several per
step (speculative decoding), and what the responses are made of."""

from __future__ import annotations

import time

import numpy as np


def _logprobs(token_ids: list[int], first_position: int):
    """The sampled token's logprob per position (the value says which position
    it was, so a shifted or extra entry shows)."""
    from vllm.v1.outputs import LogprobsLists

    n = len(token_ids)
    positions = np.arange(first_position, first_position + n)
    return LogprobsLists(
        logprob_token_ids=np.array(token_ids, dtype=np.int64).reshape(n, 1),
        logprobs=(-0.01 * (positions + 1)).astype(np.float32).reshape(n, 1),
        sampled_token_ranks=np.ones(n, dtype=np.int64),
    )


def generate_in_steps(
    tokenizer,
    prompt_ids: list[int],
    generated: list[int],
    per_step: int,
    output_kind,
    *,
    engine_stops_on_last: bool = False,
    **params,
):
    """Run the output processor over ``generated`` in steps of ``per_step``
    tokens, as the engine would report them, until the request finishes.
    The engine ends the request with the last token: max_tokens reached, or
    with ``engine_stops_on_last`` on a stop token (EOS). Returns the
    RequestOutputs made."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
    from vllm.v1.engine.output_processor import OutputProcessor

    processor = OutputProcessor(tokenizer, log_stats=False)
    sampling = SamplingParams(max_tokens=len(generated), logprobs=0, output_kind=output_kind, **params)
    request = EngineCoreRequest(
        request_id="r",
        prompt_token_ids=prompt_ids,
        mm_features=None,
        sampling_params=sampling,
        pooling_params=None,
        arrival_time=time.time(),
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
        external_req_id="r",
    )
    processor.add_request(request, None, None, 0, None)
    outputs = []
    for start in range(0, len(generated), per_step):
        step = generated[start : start + per_step]
        last = start + per_step >= len(generated)
        engine_output = EngineCoreOutput(
            request_id="r",
            new_token_ids=step,
            new_logprobs=_logprobs(step, start),
            finish_reason=None if not last else FinishReason.STOP if engine_stops_on_last else FinishReason.LENGTH,
        )
        outputs += processor.process_outputs([engine_output], time.monotonic(), None).request_outputs
        if "r" not in processor.request_states:
            break
    return outputs


def final_output(outputs) -> dict:
    """What a non-streaming response is made of."""
    assert outputs and outputs[-1].finished
    out = outputs[-1].outputs[0]
    return {
        "text": out.text,
        "token_ids": list(out.token_ids),
        "logprobs": [dict((k, round(v.logprob, 6)) for k, v in p.items()) for p in out.logprobs],
        "cumulative_logprob": round(out.cumulative_logprob, 6),
        "finish_reason": out.finish_reason,
        "stop_reason": out.stop_reason,
    }


def streamed_output(outputs) -> dict:
    """What a stream is made of: the deltas joined (usage counts the ids)."""
    assert outputs and outputs[-1].finished
    pieces = [o.outputs[0] for o in outputs]
    return {
        "text": "".join(p.text for p in pieces),
        "token_ids": [t for p in pieces for t in p.token_ids],
        "logprobs": [
            dict((k, round(v.logprob, 6)) for k, v in pos.items()) for p in pieces for pos in (p.logprobs or [])
        ],
        "finish_reason": pieces[-1].finish_reason,
        "stop_reason": pieces[-1].stop_reason,
    }
