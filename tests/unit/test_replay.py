"""An asynchronous run can be audited: `flash replay RUN_DIR` re-trains from the run's schedule
record (flash.app.schedule) and finds every step's loss and gradient norm again, bit for bit; a
record that does not explain the run (a changed reward, a changed number) is caught at its step;
a damaged record is one clear error, never a traceback. These are the record's pieces; a whole
asynchronous run killed, resumed and replayed (and a flipped reward caught) is
`test_async_run_killed_and_resumed_loses_and_repeats_no_prompt` in test_resume_e2e.py.
"""

import json

import numpy as np
import pytest
import torch

from flash.buffers.types import Group, Sample
from flash.app.schedule import count_steps, groups_from_line, interrupts, schedule_lines, step_line
from flash.errors import FlashError
from flash.train.batch import collate, flatten


def _group(pid: int, versions: list[list[int]]) -> Group:
    samples = [
        Sample(
            prompt_id=pid,
            sample_index=i,
            prompt_ids=[1, 5, 6],
            response_ids=list(range(7, 7 + len(v))),
            behav_logprobs=np.array([-0.1 * (k + 1) / 3 for k in range(len(v))], dtype=np.float32),
            versions=np.array(v),
            reward=float(i % 2),
            finish_reason="stop",
            admitted_version=v[0],
        )
        for i, v in enumerate(versions)
    ]
    return Group(prompt_id=pid, samples=samples, admitted_version=versions[0][0], data_index=pid + 100)


def test_interrupts_are_where_the_version_changed_under_a_response():
    assert interrupts([3, 3, 3]) == []
    assert interrupts([1, 1, 2, 2, 4]) == [[2, 2], [4, 4]]
    assert interrupts([]) == []


def test_a_step_line_gives_back_the_same_training_batch_through_json():
    groups = [_group(7, [[0, 0, 1], [0, 1]]), _group(3, [[1, 1], [1]])]
    line = json.loads(
        json.dumps(
            step_line(
                4, groups, {"loss": 0.125, "grad_norm": 1.5, "other": 2.0}, {"prox": "fused", "trainer_threads": 1}
            )
        )
    )
    assert line["train"] == {"loss": 0.125, "grad_norm": 1.5}
    assert line["groups"][0]["samples"][0]["interrupts"] == [[2, 1]]
    back = groups_from_line(line)
    assert [g.prompt_id for g in back] == [7, 3] and [g.data_index for g in back] == [107, 103]
    a, b = collate(flatten(groups)), collate(flatten(back))
    for field in ("input_ids", "attention_mask", "mask", "behav_logp", "versions", "rewards", "group_ids"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda line: line.pop("groups"), "field 'groups' is missing"),
        (
            lambda line: line["groups"][0]["samples"][0]["versions"].pop(),
            "versions has 2 entries for 3 response tokens",
        ),
        (lambda line: line["groups"][0]["samples"][0].update(response_ids=[1, "x", 3]), "response_ids holds"),
        (lambda line: line["groups"][0].update(prompt_id=True), "field 'prompt_id'"),
        (
            lambda line: line["groups"][0]["samples"][0].update(reward=float("inf")),
            "reward inf: a reward is a finite number",
        ),
        (lambda line: line["groups"][0].update(samples=[]), "no samples"),
    ],
)
def test_a_damaged_step_line_is_one_error_naming_the_field(damage, message):
    line = json.loads(json.dumps(step_line(2, [_group(1, [[0, 0, 0]])], {"loss": 0.5}, {})))
    damage(line)
    with pytest.raises(FlashError, match="schedule step 2") as err:
        groups_from_line(line)
    assert message in str(err.value)


def test_a_damaged_or_incomplete_record_file_is_one_error(tmp_path):
    with pytest.raises(FlashError, match="schedule.jsonl not found"):
        count_steps(tmp_path)
    good = json.dumps(step_line(0, [_group(1, [[0]])], {"loss": 0.5}, {}))
    (tmp_path / "schedule.jsonl").write_text(good + "\n{not json\n")
    with pytest.raises(FlashError, match=r"schedule.jsonl:2: not JSON"):
        count_steps(tmp_path)
    (tmp_path / "schedule.jsonl").write_text(good + "\n" + good + "\n")
    with pytest.raises(FlashError, match="schedule.jsonl:2: step 0 where step 1 is due: steps are not 0, 1, 2"):
        count_steps(tmp_path)
    assert count_steps(tmp_path, steps=1) == 1  # a replay of the first step reads no further
    (tmp_path / "schedule.jsonl").write_text(good + "\n")
    assert [line["step"] for line in schedule_lines(tmp_path)] == [0]
