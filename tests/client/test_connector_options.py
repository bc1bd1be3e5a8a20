"""Options of the vLLM and SGLang connectors and the transformers integration that are
checked before anything runs: a time of inf passed their "> 0" checks and failed later, in a
thread (a probing breaker's Event.wait raised OverflowError; gRPC refuses such a deadline);
a TCP address, with which no transfer can run, failed at every call."""

from __future__ import annotations

import math

import pytest

from kvtier.client.errors import InvalidArgumentError
from kvtier.client.integrations.sglang_config import StorageOptions
from kvtier.client.integrations.transformers import KVTierPrefixCache
from kvtier.client.integrations.vllm_config import ConnectorConfig

# Times of more years than the clients take (``kvtier.client.types.MAX_SECONDS``): they
# passed these checks, and the connector's client refused them (or, before it did, every
# call failed at once DEADLINE_EXCEEDED, a breaker's Event.wait raised OverflowError in its
# thread), an error that did not name the option.
YEARS = [pytest.param(1e10, id="1e10"), pytest.param(10**400, id="10**400")]

# Each connector's options from its extra config.
CONNECTORS = {
    "vllm": ConnectorConfig.from_extra_config,
    "sglang": StorageOptions.from_extra_config,
}


@pytest.mark.parametrize(
    "name",
    ["lookup_timeout_s", "load_timeout_s", "save_timeout_s", "retry_after_s", "shutdown_timeout_s"],
)
@pytest.mark.parametrize("value", [math.inf, math.nan, 0, *YEARS])
def test_the_vllm_connectors_times_are_positive_and_finite(name: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"{name} must be positive and finite"):
        ConnectorConfig.from_extra_config({name: value})


@pytest.mark.parametrize("name", ["lookup_timeout_s", "io_timeout_s", "retry_after_s"])
@pytest.mark.parametrize("value", [math.inf, math.nan, 0, *YEARS])
def test_the_sglang_connectors_times_are_positive_and_finite(name: str, value: float) -> None:
    with pytest.raises(ValueError, match=rf"\[{name!r}\] must be positive and finite"):
        StorageOptions.from_extra_config({name: value})


@pytest.mark.parametrize("value", [math.inf, math.nan, -1.0, *YEARS])
def test_the_sglang_connectors_late_copy_grace_is_finite(value: float) -> None:
    with pytest.raises(ValueError, match=r"\['late_copy_grace_s'\] must be finite and not neg"):
        StorageOptions.from_extra_config({"late_copy_grace_s": value})


@pytest.mark.parametrize("value", [math.inf, math.nan, 0.0, -1.0, *YEARS])
def test_the_transformers_retry_after_is_positive_and_finite(value: float) -> None:
    with pytest.raises(ValueError, match="retry_after_s must be positive and finite"):
        KVTierPrefixCache(None, None, retry_after_s=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["false", "no", 0, 1, None])
def test_regression_allow_failing_requests_of_a_string_false_kept_vllms_fail_policy(
    value: object,
) -> None:
    # The connector took bool() of the value, so "false" kept vLLM's 'fail' policy; it is
    # now a typed option like the others, refused unless true or false.
    with pytest.raises(ValueError, match=r"allow_failing_requests'\] must be true or false"):
        ConnectorConfig.from_extra_config({"allow_failing_requests": value})


@pytest.mark.parametrize("value", [True, False])
def test_allow_failing_requests_is_read_as_given(value: bool) -> None:
    assert (
        ConnectorConfig.from_extra_config({"allow_failing_requests": value}).allow_failing_requests
        is value
    )
    assert ConnectorConfig.from_extra_config({}).allow_failing_requests is False


@pytest.mark.parametrize("connector", sorted(CONNECTORS))
@pytest.mark.parametrize("address", ["127.0.0.1:50051", "dns:kvtier.local:50051", "[::1]:50051"])
def test_regression_a_tcp_address_was_taken_and_failed_at_every_call(
    connector: str, address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Both connectors register memory pools, which the daemon takes only on its Unix socket
    # (a memfd pool cannot cross TCP at all), and take no tenant token, which a session over
    # TCP needs: README said the first pool was refused, while every call failed, the
    # scheduler's lookups UNAUTHENTICATED. Such an address is now refused at engine start,
    # given as the option or through $KVTIER_ADDRESS.
    parse = CONNECTORS[connector]
    monkeypatch.delenv("KVTIER_ADDRESS", raising=False)
    with pytest.raises(ValueError, match=r"\['address'\]: .*is not a Unix socket"):
        parse({"address": address})
    monkeypatch.setenv("KVTIER_ADDRESS", address)
    with pytest.raises(ValueError, match=r"\(from \$KVTIER_ADDRESS\) is not a Unix socket"):
        parse({})


@pytest.mark.parametrize("connector", sorted(CONNECTORS))
@pytest.mark.parametrize(
    "address",
    [
        "unix:/run/x.sock",
        "unix:///run/x.sock",
        "/run/x.sock",
        "unix:x.sock",
        "./x.sock",
        "/run/a:1",
    ],
)
def test_a_unix_socket_address_is_taken(
    connector: str, address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every form the client takes as a Unix socket (relative ones and a path with a colon,
    # which reads like host:port, included), given or from $KVTIER_ADDRESS; none: the default.
    monkeypatch.delenv("KVTIER_ADDRESS", raising=False)
    assert CONNECTORS[connector]({"address": address}).address == address
    assert CONNECTORS[connector]({}).address == ""
    monkeypatch.setenv("KVTIER_ADDRESS", address)
    assert CONNECTORS[connector]({}).address == ""


@pytest.mark.parametrize("connector", sorted(CONNECTORS))
@pytest.mark.parametrize(
    ("name", "value"),
    [
        pytest.param("address", 10**5000, id="address=10**5000"),
        pytest.param("save_durable", 10**5000, id="save_durable=10**5000"),
        pytest.param("save_durable", [10**5000], id="save_durable=[10**5000]"),
        pytest.param("retry_after_s", [10**5000], id="retry_after_s=[10**5000]"),
        pytest.param("staging_bytes", [10**5000], id="staging_bytes=[10**5000]"),
    ],
)
def test_regression_an_option_holding_an_int_past_4300_digits_was_refused_unnamed(
    connector: str, name: str, value: object
) -> None:
    """A refused option's message showed its value by its repr, which Python refuses for an
    int past 4,300 digits, and for a list holding one: the ValueError raised was Python's
    own ("Exceeds the limit (4300 digits) ..."), naming no option. It names the option, and
    shows such a value by its kind (``types.shown``), as the clients' refusals do."""
    with pytest.raises(ValueError, match=rf"\[{name!r}\] must be .*, not (an int|a list)"):
        CONNECTORS[connector]({name: value})


def test_regression_vllms_load_tiers_holding_an_int_past_4300_digits_was_refused_unnamed() -> None:
    """``load_tiers`` took each item's ``str()``, which Python refuses for an int past 4,300
    digits: its ValueError named no option."""
    with pytest.raises(ValueError, match=r"\['load_tiers'\] must be a list of strings, not a"):
        ConnectorConfig.from_extra_config({"load_tiers": ["l1", 10**5000]})
    assert ConnectorConfig.from_extra_config({"load_tiers": ["L1", "l2"]}).load_tiers == (
        "l1",
        "l2",
    )


@pytest.mark.parametrize("connector", sorted(CONNECTORS))
@pytest.mark.parametrize(
    ("raw", "names"),
    [
        pytest.param({10**5000: True}, r"\[an int of 16610 bits\]", id="10**5000"),
        pytest.param({1: True, "adress": "x"}, r"\['adress', 1\]", id="1-and-adress"),
        pytest.param(
            {"namespace": {10**5000: "x"}}, r"\[an int of 16610 bits\]", id="namespace.10**5000"
        ),
        pytest.param({"namespace": {None: "x", "modle": "x"}}, r"\['modle', None\]", id="ns.None"),
    ],
)
def test_regression_an_unknown_key_that_is_no_string_was_refused_with_pythons_error(
    connector: str, raw: dict, names: str
) -> None:
    """The unknown keys were named by the repr of their sorted list: ``sorted`` refuses keys
    of mixed types (TypeError: '<' not supported between instances of 'str' and 'int'), and
    the repr an int key past 4,300 digits (Python's ValueError), neither naming the option
    that was wrong. They are named as the values are (``types.shown``)."""
    with pytest.raises(ValueError, match=rf"unknown (kv_connector_extra_config )?key\(s\) {names}"):
        CONNECTORS[connector](raw)


# The largest a Lookup's lease_ms and a Prefetch's deadline_ms hold (uint32s).
WIRE_MS = 2**32 - 1


@pytest.mark.parametrize(
    ("name", "low"),
    [pytest.param("lease_ms", 1, id="lease"), pytest.param("hint_ms", 0, id="hint")],
)
@pytest.mark.parametrize(
    "past", [pytest.param(1, id="past-max"), pytest.param(10**5000, id="huge")]
)
def test_regression_the_vllm_connectors_lease_and_hint_past_the_wire_were_refused_at_each_call(
    name: str, low: int, past: int
) -> None:
    """lease_ms (a pinning Lookup's lease) and hint_ms (a Prefetch's deadline) were checked
    for their minimum only: one past what the wire's field holds built a connector whose
    every Lookup pin (every load) and every hint the client refused, in words naming the
    request's field, not the option. Refused when the connector is built, naming the option
    and its range (the field's, as the client's refusals take it); the range's ends pass."""
    message = rf"^kvtier connector: {name} must be from {low} to {WIRE_MS} ms "
    for value in (WIRE_MS + past, low - 1):
        with pytest.raises(ValueError, match=message):
            ConnectorConfig.from_extra_config({name: value})
    for value in (low, WIRE_MS):
        assert getattr(ConnectorConfig.from_extra_config({name: value}), name) == value


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(-1, id="negative"),
        pytest.param(WIRE_MS + 1, id="past-max"),
        pytest.param(10**5000, id="huge"),
    ],
)
def test_regression_the_transformers_lease_past_the_wire_was_refused_at_each_load(
    value: int,
) -> None:
    """KVTierPrefixCache's lease_ms was not checked: one a Lookup's lease_ms does not hold
    was refused at every load (each a miss, counted as a failure). Refused at construction,
    naming the option and its range."""
    with pytest.raises(InvalidArgumentError, match=rf"^lease_ms: must be from 0 to {WIRE_MS} ms "):
        KVTierPrefixCache(None, None, lease_ms=value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("lease_ms", "message"),
    [
        (True, r"^lease_ms: expected int, not bool$"),
        (1.5, r"^lease_ms: expected int, not float$"),
        ("5", r"^lease_ms: expected int, not str$"),
    ],
)
def test_regression_a_transformers_lease_of_the_wrong_type_was_refused_at_every_load(
    lease_ms: object, message: str
) -> None:
    """``lease_ms`` was checked only against its range: True and 1.5 passed, and every
    load's pinning Lookup was then refused (a failure the integration degrades to a
    recompute, pausing kvtier). Refused as the vLLM connector refuses its own, when built,
    before a client is used."""
    with pytest.raises(InvalidArgumentError, match=message):
        KVTierPrefixCache(None, None, lease_ms=lease_ms)  # type: ignore[arg-type]


@pytest.mark.parametrize("connector", sorted(CONNECTORS))
@pytest.mark.parametrize(
    "extra", [[["address", "x"]], ["lookup_timeout_s"], 5, "address", b"x", [], 0, ""]
)
def test_regression_an_extra_config_that_is_no_dict_raised_pythons_error(
    connector: str, extra: object
) -> None:
    """An extra config that is no dict (SGLang's is JSON from its command line: a list or a
    number parses too) raised Python's TypeError (vLLM: ``dict()`` of it) or AttributeError
    (SGLang: its ``items``), naming nothing, or, when empty, was taken as no config: refused
    as every other bad option, naming what was given."""
    with pytest.raises(ValueError, match=r" must be a dict, not "):
        CONNECTORS[connector](extra)  # type: ignore[operator]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_tokens": "16"}, r"^block_tokens: expected int, not str$"),
        ({"block_tokens": None}, r"^block_tokens: expected int, not NoneType$"),
        ({"block_tokens": 16.0}, r"^block_tokens: expected int, not float$"),
        ({"block_tokens": True}, r"^block_tokens: expected int, not bool$"),
        ({"block_tokens": 0}, r"^block_tokens: must be at least 1 \(got 0\)$"),
        ({"staging_tokens": math.nan}, r"^staging_tokens: expected int, not float$"),
        ({"staging_tokens": math.inf}, r"^staging_tokens: expected int, not float$"),
        ({"staging_tokens": 10**5000}, r"^staging_tokens: must hold at most "),
        ({"staging_tokens": "4096"}, r"^staging_tokens: expected int, not str$"),
        ({"retry_after_s": "5"}, r"^retry_after_s: expected a number of seconds, not '5'$"),
        ({"retry_after_s": None}, r"^retry_after_s: expected a number of seconds, not None$"),
        ({"retry_after_s": True}, r"^retry_after_s: expected a number of seconds, not True$"),
        ({"model_id": 0}, r"^model_id: expected str, not int$"),
        ({"revision": None}, r"^revision: expected str, not NoneType$"),
        ({"tenant": b"t"}, r"^tenant: expected str, not bytes$"),
    ],
)
def test_regression_the_transformers_integrations_arguments_of_the_wrong_type_failed_untyped(
    kwargs: dict[str, object], message: str
) -> None:
    """KVTierPrefixCache compared its sizes and retry_after_s unchecked: a str or None raised
    TypeError from "<", a NaN or infinite staging_tokens ValueError or OverflowError from
    math.ceil, one past 4,300 digits OverflowError from its division; a bool retry_after_s
    was taken as 1 s, and a model_id that is no str (0, None) silently replaced by the
    model's type. Each is InvalidArgumentError naming it, before the model or the client is
    used."""
    with pytest.raises(InvalidArgumentError, match=message):
        KVTierPrefixCache(None, None, **kwargs)  # type: ignore[arg-type]
