"""Read a Prometheus text page (vLLM's /metrics) into plain values."""

from __future__ import annotations


def metric_samples(text: str):
    """(family name, sample) for each sample of a Prometheus /metrics page."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            yield family.name, sample


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {metric name: value summed over its label sets},
    plus ``name{label=value}`` sums for each single label
    (e.g. ``vllm:request_success_total{finished_reason=length}``)."""
    out: dict[str, float] = {}
    for _, s in metric_samples(text):
        out[s.name] = out.get(s.name, 0.0) + s.value
        for k, v in s.labels.items():
            if k not in ("model_name", "engine"):
                key = f"{s.name}{{{k}={v}}}"
                out[key] = out.get(key, 0.0) + s.value
    return out


def info_labels(text: str, name: str) -> dict[str, str]:
    """The labels of an info metric (e.g. vllm:cache_config_info) on a /metrics page."""
    for family, s in metric_samples(text):
        if name in (s.name, family):
            return dict(s.labels)
    return {}
