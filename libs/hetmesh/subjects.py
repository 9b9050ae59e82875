"""The one table of NATS subjects. Every service builds its subjects with these functions.

Work subjects encode role, vendor and accelerator kind so that an operator can watch one
pool with the `nats` CLI (`nats sub 'hetmesh.work.prefill.amd.>'`) and so that a worker
pool can also be fed as one (`hetmesh.work.<role>.<vendor>.<accelerator>`). They are the
subjects of one JetStream work-queue stream (`WORK_STREAM`); each is read through a durable
consumer that pushes to its own `hetmesh.workq.<consumer>` subject (`hetmesh.workqueue`).
"""

from __future__ import annotations

from typing import NamedTuple

PREFIX = "hetmesh"

SUBMIT = f"{PREFIX}.sched.submit"  # request/reply: InferenceRequest -> SubmitReply
SCHED_STATUS = f"{PREFIX}.sched.status"  # request/reply, empty -> SchedulerStatus
SCHED_ALIVE_ALL = f"{PREFIX}.sched.alive.*"  # every scheduler's beat: for gateways (who answers) and schedulers (whose bookings count)
GATEWAY_ALIVE_ALL = f"{PREFIX}.gateway.alive.*"  # every gateway's beat (empty): workers drop a dead one's work
FINISHED = f"{PREFIX}.sched.finished"
SCHED_BOOKED = f"{PREFIX}.sched.booked"  # every scheduler -> every scheduler: its placements (BookedBatch)
CANCEL = f"{PREFIX}.cancel"
RESUME = f"{PREFIX}.resume"
HEARTBEAT_ALL = f"{PREFIX}.heartbeat.*"
KV_EVENTS_ALL = f"{PREFIX}.kv.events.*"
KV_TRANSFER = f"{PREFIX}.kv.transfer"
KV_DONE = f"{PREFIX}.kv.done"  # prefill worker -> kv-transfer: a direct stream's outcome
KV_RESYNC = f"{PREFIX}.kv.resync"  # scheduler -> all workers: republish the whole prefix cache
EVENTS_ALL = f"{PREFIX}.event.>"
TURNED_AWAY = f"{PREFIX}.sched.turned_away"  # gateway -> scheduler: a request refused before the scheduler saw it
DEMAND = f"{PREFIX}.sched.demand"  # scheduler -> planner: windowed demand per model, every planner.interval_s
PLAN = f"{PREFIX}.planner.plan"  # the leading planner's proposal (advise and act), every planner.interval_s
PLANNER_BUCKET = "hetmesh_planner"  # JetStream KV bucket holding the planner leader's lease (key "leader")
PLAN_BUCKET = "hetmesh_planner_plan"  # JetStream KV bucket: the leader's last PlanProposal (key "latest")
WORK_ALL = f"{PREFIX}.work.>"  # every work subject: what the work-queue stream stores
WORK_STREAM = "HETMESH_WORK"  # JetStream stream names may not hold '.'

# Queue groups: replicas of a service share work; workers of one pool share pool work.
SCHEDULER_QUEUE = "scheduler"
KV_TRANSFER_QUEUE = "kv-transfer"


def token_safe(part: str) -> str:
    """NATS subject tokens may not hold '.', '*', '>' or whitespace."""
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in part)


def work_pool(role: str, vendor: str, accelerator: str) -> str:
    return f"{PREFIX}.work.{role}.{token_safe(vendor)}.{token_safe(accelerator)}"


def work_direct(role: str, vendor: str, accelerator: str, worker_id: str) -> str:
    return f"{work_pool(role, vendor, accelerator)}.{token_safe(worker_id)}"


def work_consumer(work_subject: str) -> str:
    """The durable consumer of one work subject (direct or pool): its tokens after the prefix, '_'-joined
    (consumer names may not hold '.')."""
    return work_subject[len(PREFIX) + 1:].replace(".", "_")


def work_deliver(work_subject: str) -> str:
    """Where that consumer pushes: a fixed subject, so that every worker process (and a re-created
    consumer) meets the others there; outside `WORK_ALL`, which the stream would capture."""
    return f"{PREFIX}.workq.{work_consumer(work_subject)}"


def sched_submit(instance: str) -> str:
    """One scheduler's own submit subject: a gateway that sent it a request knows whom to watch."""
    return f"{SUBMIT}.{token_safe(instance)}"


def sched_alive(instance: str) -> str:
    return f"{PREFIX}.sched.alive.{token_safe(instance)}"


def gateway_alive(instance: str) -> str:
    return f"{PREFIX}.gateway.alive.{token_safe(instance)}"


def reply_gateway(reply_subject: str) -> str:
    """The gateway instance a reply subject (`reply_to`) belongs to; "" for another kind of subject."""
    parts = reply_subject.split(".")
    return parts[2] if len(parts) == 4 and parts[1] == "resp" else ""


def heartbeat(worker_id: str) -> str:
    return f"{PREFIX}.heartbeat.{token_safe(worker_id)}"


def worker_command(worker_id: str) -> str:
    return f"{PREFIX}.worker.command.{token_safe(worker_id)}"


def kv_events(worker_id: str) -> str:
    return f"{PREFIX}.kv.events.{token_safe(worker_id)}"


def kv_data(transfer_id: str) -> str:
    return f"{PREFIX}.kv.data.{token_safe(transfer_id)}"


def kv_recv(worker_id: str) -> str:
    return f"{PREFIX}.kv.recv.{token_safe(worker_id)}"


def kv_landed(worker_id: str) -> str:
    return f"{PREFIX}.kv.landed.{token_safe(worker_id)}"


def reply(request_id: str) -> str:
    return f"{PREFIX}.resp.{token_safe(request_id)}"


def reply_inbox(instance: str) -> str:
    """One gateway instance's single wildcard subscription covering all its requests' reply subjects."""
    return f"{PREFIX}.resp.{token_safe(instance)}.*"


def reply_to(instance: str, key: str) -> str:
    """A reply subject under `reply_inbox(instance)`; `key` names one request attempt."""
    return f"{PREFIX}.resp.{token_safe(instance)}.{token_safe(key)}"


def event(service: str) -> str:
    return f"{PREFIX}.event.{token_safe(service)}"


class SubjectRow(NamedTuple):
    subject: str
    publisher: str
    subscriber: str
    message: str
    note: str


TABLE: tuple[SubjectRow, ...] = (
    SubjectRow(SUBMIT, "gateway", "scheduler (queue group)", "InferenceRequest -> SubmitReply", "request/reply"),
    SubjectRow(SCHED_STATUS, "gateway (/ready)", "scheduler (queue group)", "empty -> SchedulerStatus", "request/reply"),
    SubjectRow(f"{SUBMIT}.<scheduler>", "gateway", "that scheduler", "InferenceRequest -> SubmitReply",
               "request/reply to one live scheduler; resent to another if it goes silent before it answers"),
    SubjectRow(f"{PREFIX}.sched.alive.<scheduler>", "every scheduler", "gateways", "its count of reconnects (text)",
               "every mesh.heartbeat_interval_s: the schedulers that take submits; a new count: what it was sent "
               "meanwhile may be lost, and gateways send it again"),
    SubjectRow(f"{PREFIX}.gateway.alive.<gateway>", "every gateway", "workers", "empty",
               "every mesh.heartbeat_interval_s: a worker cancels the requests of a gateway silent for "
               "mesh.heartbeat_timeout_s"),
    SubjectRow(f"{PREFIX}.work.<role>.<vendor>.<accelerator>.<worker_id>", "scheduler (`js.publish`)", f"stream {WORK_STREAM}",
               "WorkItem", "direct placement; work-queue stream, `Nats-Msg-Id` <request_id>-<attempt>-stream "
               "(FULL, DECODE) or -prefill"),
    SubjectRow(f"{PREFIX}.work.<role>.<vendor>.<accelerator>", "scheduler (`js.publish`)", f"stream {WORK_STREAM}",
               "WorkItem", "any worker of the pool; same stream"),
    SubjectRow(f"{PREFIX}.workq.work_<role>_<vendor>_<accelerator>_<worker_id>", f"stream {WORK_STREAM} (durable consumer)",
               "that worker", "WorkItem", "push delivery; worker acks once its engine took the item"),
    SubjectRow(f"{PREFIX}.workq.work_<role>_<vendor>_<accelerator>", f"stream {WORK_STREAM} (durable consumer)",
               "the pool (queue group = deliver group)", "WorkItem", "one shared consumer per pool"),
    SubjectRow(f"{PREFIX}.resp.<gateway>.<request_id>-<attempt>", "workers, scheduler", "gateway", "TokenChunk | RequestError | WorkerLost | Working", "per-request stream"),
    SubjectRow(CANCEL, "gateway", "workers, scheduler, kv-transfer", "Cancel", "broadcast"),
    SubjectRow(RESUME, "gateway", "workers", "Resume", "broadcast: republish a stream's chunks after a bus gap"),
    SubjectRow(FINISHED, "workers", "scheduler", "FinishedBatch (JSON array of Finished)", "in-flight bookkeeping, batched"),
    SubjectRow(SCHED_BOOKED, "every scheduler", "every scheduler", "BookedBatch (JSON array of Booked)",
               "each scheduler's placements, batched: the others count them until the workers' next heartbeats"),
    SubjectRow(f"{PREFIX}.heartbeat.<worker_id>", "workers", "scheduler", "Heartbeat",
               "liveness + load; every 2 s a sample of its engine steps and its requests' first-token gaps (the online fit)"),
    SubjectRow(f"{PREFIX}.kv.events.<worker_id>", "workers", "scheduler (-> Redis index)", "KvEvent", "prefix blocks stored/removed"),
    SubjectRow(KV_RESYNC, "scheduler", "every worker", "KvResync", "Redis back or restarted, or a new index writer: republish caches"),
    SubjectRow(KV_TRANSFER, "prefill worker", "kv-transfer (queue group)", "KvTransferRequest (-> KvTransferAccept)", "direct with the KV port in the placement: a notice that opens the record; else request/reply, the accept naming the KV port (direct) or a data subject (relay)"),
    SubjectRow(KV_DONE, "prefill worker", "kv-transfer", "KvTransferDone", "direct: the stream's outcome, for the records"),
    SubjectRow(f"{PREFIX}.kv.data.<transfer_id>", "prefill worker", "kv-transfer", "raw KV bytes", "relay only; chunked; headers Kv-Seq, Kv-Last"),
    SubjectRow(f"{PREFIX}.kv.recv.<worker_id>", "kv-transfer", "decode worker", "raw KV bytes", "relay only; chunked; headers Kv-Transfer, Kv-Seq"),
    SubjectRow(f"{PREFIX}.kv.landed.<worker_id>", "kv-transfer, prefill worker (on failure)", "decode worker", "KvLanded", "relay: decode may start; either: the transfer failed"),
    SubjectRow(TURNED_AWAY, "gateway", "scheduler (queue group)", "TurnedAway", "a request the gateway refused for want of a worker: still demand for the planner"),
    SubjectRow(DEMAND, "scheduler", "planner", "DemandReport", "demand per model over the last planner.window_s, every planner.interval_s"),
    SubjectRow(PLAN, "planner (the leader)", "operators (`nats sub hetmesh.planner.plan`), tests", "PlanProposal",
               "current vs proposed layout and the moves sent (act) or advised; the last one also in KV bucket "
               f"`{PLAN_BUCKET}` (`hetmesh plan --live`)"),
    SubjectRow(f"{PREFIX}.worker.command.<worker_id>", "planner (the leader, act mode)", "that worker",
               "WorkerCommand (RoleSwitch or ModelSwitch)", "drain; RoleSwitch: serve the new role (no reload); "
               "ModelSwitch: release the engine, load the model's, rejoin; leader lease: KV bucket "
               f"`{PLANNER_BUCKET}`"),
    SubjectRow(f"{PREFIX}.event.<service>", "every service", "operators, tests", "EventBatch (JSON array of ServiceEvent)", "the services' own records, batched"),
)


def markdown_table() -> str:
    lines = ["| subject | publisher | subscriber | message | note |", "|---|---|---|---|---|"]
    lines += [f"| `{r.subject}` | {r.publisher} | {r.subscriber} | {r.message} | {r.note} |" for r in TABLE]
    return "\n".join(lines)
