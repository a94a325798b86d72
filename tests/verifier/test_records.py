"""The round record: what the verifier writes is exactly what its readers read."""

import json

import pytest

from goodspeed.verifier.records import CLOSE_REASONS, SCHEMA, DrafterRound, LocalRound, RecordError, RoundRecord


def a_record(local=None):
    rows = (DrafterRound("a#1", "a", 4, 2, 3, 0.55, 2.4, 5, False, 0.012),
            DrafterRound("b#2", "b", 0, 0, 1, 0.5, 1.0, 1, True, None))
    return RoundRecord(7, 0.02, 0.01, 0.008, 0.001, 2, 12, rows, local, ts=1700000000.123456)


@pytest.mark.parametrize("local", [None, LocalRound(3, 6, 4, 7, 2, 1)])
def test_json_round_trip(local):
    record = a_record(local)
    event = json.loads(record.to_json())
    assert event["event"] == "round" and event["schema"] == SCHEMA
    assert RoundRecord.from_event(event) == record


def test_a_missing_or_unknown_field_is_an_error_not_a_blank():
    event = json.loads(a_record().to_json())
    event["drafters"][0]["x"] = event["drafters"][0].pop("gained")
    with pytest.raises(RecordError, match=r"missing \['gained'\], unknown \['x'\]"):
        RoundRecord.from_event(event)
    event = json.loads(a_record().to_json())
    del event["budget"]
    with pytest.raises(RecordError, match="missing"):
        RoundRecord.from_event(event)
    event = json.loads(a_record(LocalRound(1, 1, 1, 1, 1, 0)).to_json())
    event["local"]["extra"] = 1
    with pytest.raises(RecordError, match="local"):
        RoundRecord.from_event(event)


def test_other_schemas_and_other_events_are_refused():
    event = json.loads(a_record().to_json())
    with pytest.raises(RecordError, match="schema"):
        RoundRecord.from_event(event | {"schema": SCHEMA + 1})
    with pytest.raises(RecordError, match="not a round event"):
        RoundRecord.from_event({"event": "drop"})
    with pytest.raises(RecordError, match="list"):
        RoundRecord.from_event(event | {"drafters": None})


@pytest.mark.parametrize("key, value", [("mode", "lockstep"), ("closed", "timeout")])
def test_a_mode_or_close_reason_this_reader_does_not_know_is_refused(key, value):
    event = json.loads(a_record().to_json())
    assert RoundRecord.from_event(event | {key: ("async" if key == "mode" else "none-due")}).closed in CLOSE_REASONS
    with pytest.raises(RecordError, match=f"{key} '{value}' is not one of"):
        RoundRecord.from_event(event | {key: value})
