"""/metrics in OpenMetrics (FakeBackend, no socket): a scrape that asks for OpenMetrics without naming an
escaping (Prometheus 2's default Accept header) gets the `vllm:*` / `worldserve:*` names in its samples as in
their `# TYPE` lines (prometheus_client had written `vllm_*` samples under `# TYPE vllm:*`: no parser took
the scrape, and Prometheus stored names no vLLM dashboard queries)."""

from __future__ import annotations

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families
from serving_helpers import asgi_server

pytestmark = pytest.mark.anyio
PROMETHEUS_2 = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")  # fmt: skip
PROMETHEUS_3 = ("application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.5,"
                "text/plain;version=0.0.4;q=0.2,*/*;q=0.1")  # fmt: skip


@pytest.mark.parametrize(
    "accept",
    [PROMETHEUS_2, PROMETHEUS_3, "application/openmetrics-text", "application/openmetrics-text; version=1.0.0; "
     "escaping=values"],
)  # fmt: skip
async def test_openmetrics_samples_keep_their_families_names(tmp_path, accept):
    async with asgi_server(tmp_path) as http:
        r = await http.get("/metrics", headers={"Accept": accept})
        filtered = await http.get("/metrics", headers={"Accept": accept, "Accept-Encoding": "gzip"},
                                  params={"name[]": "vllm:omni_requests_success_total"})  # fmt: skip
    assert r.headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
    # (the parser had raised "Clashing name" on the first family named with a ":")
    families = list(text_string_to_metric_families(r.text))
    samples = {s.name: f.name for f in families for s in f.samples}
    assert samples["vllm:omni_requests_success_total"] == "vllm:omni_requests_success"
    assert samples["worldserve:request_failure_total"] == "worldserve:request_failure"
    assert samples["vllm:omni_e2e_request_latency_seconds_bucket"] == "vllm:omni_e2e_request_latency_seconds"
    assert not [name for name in samples if name.startswith(("vllm_", "worldserve_"))]
    assert filtered.headers["content-encoding"] == "gzip"  # (httpx decodes it)
    assert [f.name for f in text_string_to_metric_families(filtered.text)] == ["vllm:omni_requests_success"]


async def test_every_escaping_writes_a_family_and_its_samples_alike(tmp_path):
    """Dots escaping (Prometheus 3's `escaping=dots`) doubles the underscores of a name: of its samples too."""
    async with asgi_server(tmp_path) as http:
        text = (await http.get("/metrics", headers={"Accept": "application/openmetrics-text;version=1.0.0;"
                                                               "escaping=dots"})).text  # fmt: skip
    families = list(text_string_to_metric_families(text))
    success = next(f for f in families if f.name == "vllm:omni__requests__success")
    assert "vllm:omni__requests__success_total" in {s.name for s in success.samples}
    assert {"model__name", "finished__reason"} <= set(success.samples[0].labels)


@pytest.mark.parametrize("version", ["abc", "1.0.0-rc1"])
async def test_an_openmetrics_version_that_does_not_parse_gets_the_text_format(tmp_path, version):
    """prometheus_client compared the version's parts with ints: `version=abc` was a 500 on every scrape."""
    async with asgi_server(tmp_path) as http:
        r = await http.get("/metrics", headers={"Accept": f"application/openmetrics-text; version={version}"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text[:200]
    assert "vllm:num_requests_running" in r.text
