"""The gateway-to-worker contract: typed jobs and channel messages, strict on the wire, queued by task name."""

from __future__ import annotations

import json

import pytest

from speculation.jobs import channel, queue
from speculation.jobs.job import JobFormatError, ProdJob, ShadowJob

PROD = ProdJob(
    request_id="r-1",
    endpoint_id=3,
    prompt_ids=[1, 5, 6],
    max_tokens=8,
    k=4,
    path="local",
    node_class="cpu",
    sampling={"temperature": 0.7, "top_k": 0, "top_p": 0.9, "seed": 5},
    stop={"stop": ["\n"]},
    workload="chat",
)


def test_it_reads_back_a_prod_job_from_its_json_wire_form():
    assert ProdJob.from_dict(json.loads(json.dumps(PROD.to_dict()))) == PROD


def test_it_refuses_a_job_with_a_field_it_does_not_know_naming_it():
    with pytest.raises(JobFormatError, match="no field 'priority'"):
        ProdJob.from_dict({**PROD.to_dict(), "priority": 1})


def test_it_refuses_a_job_without_a_field_it_needs_naming_it():
    wire = PROD.to_dict()
    del wire["max_tokens"]
    with pytest.raises(JobFormatError, match="needs 'max_tokens'"):
        ProdJob.from_dict(wire)


def test_optional_fields_take_their_defaults():
    wire = {name: value for name, value in PROD.to_dict().items() if name not in ("sampling", "stop", "workload")}
    job = ProdJob.from_dict(wire)
    assert (job.sampling, job.stop, job.workload) == (None, {}, "")


def test_a_shadow_job_round_trips_and_is_as_strict():
    job = ShadowJob(
        endpoint_id=1, request_id="s", prompt_ids=[1], output_ids=[2, 3], finish_reason="length", max_tokens=2,
        temperature=0.0, latency_ms=12.5,
    )  # fmt: skip
    assert ShadowJob.from_dict(job.to_dict()) == job
    with pytest.raises(JobFormatError, match="no field 'node_class'"):
        ShadowJob.from_dict({**job.to_dict(), "node_class": "cpu"})


@pytest.mark.parametrize(
    "message",
    [
        channel.Started(),
        channel.Ready(),
        channel.Tokens([4, 5], "ab"),
        channel.Done(finish_reason="stop", stop_reason="\n", text="c", stats={"k": 4}),
        channel.Error("no target"),
        channel.Cancelled(3),
    ],
)
def test_every_channel_message_round_trips_with_its_type(message):
    wire = json.loads(json.dumps(channel.to_wire(message)))
    assert wire["type"] == message.type
    assert channel.from_wire(wire) == message


def test_a_channel_message_of_an_unknown_type_or_field_is_refused():
    with pytest.raises(ValueError, match="unknown channel message type 'progress'"):
        channel.from_wire({"type": "progress"})
    with pytest.raises(ValueError, match="'tokens'"):
        channel.from_wire({"type": "tokens", "ids": [], "text": "", "extra": 1})


def test_the_gateway_queues_by_task_name_on_the_node_class_queue(monkeypatch):
    # given: the broker call recorded instead of sent
    sent = []
    monkeypatch.setattr(queue.app, "send_task", lambda name, **kwargs: sent.append((name, kwargs)))
    # when
    queue.enqueue_prod(PROD, expires_s=5.0)
    # then: the worker's registered task, the job's wire form, its node class's GPU queue
    name, kwargs = sent[0]
    assert name == queue.PROD_TASK == "speculation.tasks.prod_generate_task"
    assert (kwargs["args"], kwargs["queue"], kwargs["expires"]) == ([PROD.to_dict()], "gpu.cpu", 5.0)


def test_the_worker_registers_the_task_names_the_gateway_sends():
    from speculation.worker import tasks

    registered = {task.name for task in (tasks.prod_generate_task, tasks.shadow_measure_task)}
    registered |= {tasks.calibrate_costs_task.name, tasks.replay_candidates_task.name}
    registered.add(tasks.train_eagle_head_task.name)
    sent = {queue.PROD_TASK, queue.SHADOW_TASK, queue.CALIBRATION_TASK, queue.CANDIDATES_TASK, queue.TRAINING_TASK}
    assert registered == sent
