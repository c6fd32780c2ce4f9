"""A realtime session.start's request fields (`/v1/realtime/video`, api/realtime.py): vLLM-Omni's merge of its
`sampling_params` object into the request (a request field the message left out takes its value there, any
other key joins `extra_params`, its own `extra_params` keys too), and the names errors then give: a value that
came in `sampling_params` is named there (`sampling_params.num_inference_steps`), not by the field it filled.
"""

from __future__ import annotations

from typing import Any

from worldserve.api.errors import APIError
from worldserve.api.protocol import VideoCreateRequest
from worldserve.api.video_inputs import json_object_field


def merged_fields(msg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """(session.start's request fields with its sampling_params merged in, as vLLM-Omni merges them; each
    merged field's name -> the name session.start gave it). APIError naming a sampling_params that is no
    object."""
    fields = {k: v for k, v in msg.items() if k not in ("type", "format", "sampling_params")}
    sampling = msg.get("sampling_params")
    if sampling is not None and not isinstance(sampling, dict):
        raise APIError(400, "sampling_params must be a JSON object", param="sampling_params")
    origins: dict[str, str] = {}
    if sampling:
        extra = dict(json_object_field(fields.get("extra_params"), "extra_params") or {})
        for key, value in sampling.items():
            if key == "extra_params":  # (its keys join the top level's)
                nested = json_object_field(value, "sampling_params.extra_params") or {}
                extra.update(nested)
                origins.update({f"extra_params.{k}": f"sampling_params.extra_params.{k}" for k in nested})
            elif key in VideoCreateRequest.model_fields and key not in fields:
                fields[key] = value
                origins[key] = f"sampling_params.{key}"
            else:
                extra[key] = value
                origins[f"extra_params.{key}"] = f"sampling_params.{key}"
        if extra:
            fields["extra_params"] = extra
    return fields, origins


def sent_name(param: str | None, origins: dict[str, str]) -> str | None:
    """An error's `param` as session.start named it: a merged field (or a part of it, `.key` / `[i]` below
    it) renamed by `origins` (merged_fields')."""
    if param is None:
        return None
    for merged, sent in origins.items():
        if param == merged or param.startswith((merged + ".", merged + "[")):
            return sent + param[len(merged) :]
    return param
