"""build_app(client, settings): one frozen AppSettings value may build several apps (an in-process restart),
each with its own state: --seed's sequence starts again in each."""

from __future__ import annotations

from serving_helpers import make_client

from worldserve.api.app import build_app
from worldserve.api.settings import AppSettings
from worldserve.chat_params import ChatParams
from worldserve.sampling.chat_defaults import RequestSeeds


def test_two_apps_built_from_one_settings_value_each_start_the_seed_sequence(tmp_path):
    """AppSettings is "one frozen value" (the server's flags), but its `request_seeds` is a stateful
    RequestSeeds that build_app's dataclasses.replace copies by reference: every app built from the same
    settings draws from one shared sequence. --seed's promise (RequestSeeds' docstring: a restarted server
    answers the same unseeded requests, in the same order, the same way) then fails for a second app built
    from the same settings (an in-process restart, a test reusing a settings value): its first unseeded chat
    gets the first app's third seed, not the sequence's first."""
    settings = AppSettings(seed=5)
    first = build_app(make_client(tmp_path / "a"), settings).state.ws
    again = build_app(make_client(tmp_path / "b"), settings).state.ws
    unseeded = ChatParams()
    seeds_first = [first.seeded(unseeded).seed for _ in range(2)]
    seeds_again = [again.seeded(unseeded).seed for _ in range(2)]
    fresh = RequestSeeds(5)
    assert seeds_first == [fresh.next(), fresh.next()]
    assert seeds_again == seeds_first  # (now: the shared sequence's 3rd and 4th seeds)


def test_the_route_log_lists_each_path_once(tmp_path):
    """serve's "Route: ..." log (route_table) merged the app's routes with the OpenAPI paths, and the two
    spell a path parameter's converter differently: GET /v1/models/{model} was listed twice, once as
    `{model:path}`."""
    from worldserve.api.app import route_table

    paths = [path for path, _ in route_table(build_app(make_client(tmp_path)))]
    assert "/v1/models/{model}" in paths and not [p for p in paths if ":" in p]
    assert len(paths) == len(set(paths))
