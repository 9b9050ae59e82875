from pathlib import Path

import msgspec
import pytest
from nats.js.api import PubAck, RetentionPolicy, StorageType

from hetmesh import config, subjects, workqueue
from hetmesh.protocol import InferenceRequest, Phase, Placement, SamplingParams, WorkItem

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_cluster_files_load() -> None:
    for p in (ROOT / "ops" / "clusters").glob("*.toml"):
        cfg = config.load(p)
        assert cfg.models and cfg.workers, p


def test_seed_case_cluster_shape() -> None:
    cfg = config.load(ROOT / "ops/clusters/seed-case-study.toml")
    by = {g.accelerator: g for g in cfg.workers}
    assert by["amd-mi300x"].count == 1 and by["amd-mi300x"].devices == 8
    assert by["amd-mi308x"].count == 2 and by["amd-mi308x"].devices == 8


def assert_rejected(tmp_path: Path, cluster: str, error: type[Exception], match: str) -> None:
    bad = tmp_path / "c.toml"
    bad.write_text(cluster)
    with pytest.raises(error, match=match):
        config.load(bad)


def test_unknown_field_and_unknown_model_rejected(tmp_path: Path) -> None:
    assert_rejected(tmp_path, '[mesh]\nnats = "x"\n', Exception, "nats")
    assert_rejected(tmp_path, '[[models]]\nname="a"\n[[workers]]\nname="w"\nmodel="b"\naccelerator="amd-mi300x"\n',
                    KeyError, "b")


def test_a_vllm_group_over_several_devices_runs_tensor_parallel_only(tmp_path: Path) -> None:
    group = '[[models]]\nname="a"\npath="/m"\n[[workers]]\nname="w"\nmodel="a"\naccelerator="nvidia-h100"\nengine="vllm"\n'
    assert_rejected(tmp_path, group + 'devices=8\nparallel="dp"\n', ValueError, "runs parallel = \"tp\" over its 8")
    for ok in ('devices=8\nparallel="tp"\n', 'devices=1\nparallel="dp"\n', ''):
        (tmp_path / "ok.toml").write_text(group + ok)
        assert config.load(tmp_path / "ok.toml").workers[0].engine == "vllm"


def test_env_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HETMESH_NATS_URL", "nats://10.0.0.1:1")
    monkeypatch.setenv("HETMESH_POLICY", "round_robin")
    cfg = config.load()
    assert cfg.mesh.nats_url == "nats://10.0.0.1:1" and cfg.scheduler.policy == "round_robin"


def test_work_subjects_encode_vendor_and_accelerator() -> None:
    assert subjects.work_direct("prefill", "amd", "amd-mi300x", "mi300x-0") == "hetmesh.work.prefill.amd.amd-mi300x.mi300x-0"
    assert subjects.reply("a.b c") == "hetmesh.resp.a_b_c"


def test_docs_subject_table_is_the_code_table() -> None:
    assert subjects.markdown_table() in (ROOT / "docs" / "architecture.md").read_text()


def test_work_queue_names_and_config(tmp_path: Path) -> None:
    direct = subjects.work_direct("decode", "nvidia", "nvidia-h100", "h100-0")
    pool = subjects.work_pool("decode", "nvidia", "nvidia-h100")
    assert subjects.work_consumer(direct) == "work_decode_nvidia_nvidia-h100_h100-0"
    # Pushed outside the stream's subjects (else the stream would store its own deliveries).
    assert subjects.work_deliver(pool) == "hetmesh.workq.work_decode_nvidia_nvidia-h100"
    assert not subjects.work_deliver(pool).startswith(subjects.WORK_ALL[:-1])
    sc = workqueue.stream_config(config.WorkQueueConfig())
    assert sc.subjects == [subjects.WORK_ALL] and sc.retention == RetentionPolicy.WORK_QUEUE
    assert sc.storage == StorageType.FILE and sc.max_msgs and sc.max_bytes and sc.max_age  # bounded
    cc = workqueue.consumer_config(pool, config.WorkQueueConfig(), pool=True)
    assert cc.deliver_group == cc.durable_name and cc.filter_subject == pool
    assert workqueue.consumer_config(direct, config.WorkQueueConfig(), pool=False).deliver_group is None
    assert_rejected(tmp_path, '[work_queue]\nstorage = "disk"\n', ValueError, "storage")
    assert_rejected(tmp_path, '[work_queue]\nstorage = "memory"\nmax_age_s = 60\nduplicate_window_s = 120\n',
                    ValueError, "duplicate_window_s")


def test_the_wedge_timeout_defaults_to_a_third_of_the_stall_timeout_and_stays_below_it(tmp_path: Path) -> None:
    assert config.MeshConfig().wedge_s == 20.0 and config.MeshConfig(stall_timeout_s=3.0).wedge_s == 1.0
    assert config.MeshConfig(wedge_timeout_s=0.0).wedge_s == 0.0  # off
    assert_rejected(tmp_path, "[mesh]\nstall_timeout_s = 10.0\nwedge_timeout_s = 10.0\n", ValueError,
                    "wedge_timeout_s must be >= 0")
    assert_rejected(tmp_path, "[mesh]\nwedge_timeout_s = -1.0\n", ValueError, "below mesh.stall_timeout_s")


def test_item_ids_and_recent_ids() -> None:
    req = InferenceRequest(request_id="r1", model="m", prompt_tokens=[1], block_hashes=[], sampling=SamplingParams(max_tokens=1),
                           reply_subject="x", arrival_ts=0.0, attempt=2)
    place = Placement(mode="disaggregated", decode_worker="d", prefill_worker="p")
    ids = {ph: workqueue.msg_id(WorkItem(request=req, phase=ph, placement=place)) for ph in Phase}
    # One id for the half that streams, whichever mode placed the attempt: the work queue stores one of them.
    assert ids == {Phase.PREFILL: "r1-2-prefill", Phase.DECODE: "r1-2-stream", Phase.FULL: "r1-2-stream"}
    again = msgspec.structs.replace(req, attempt=3)
    assert workqueue.msg_id(WorkItem(request=again, phase=Phase.FULL, placement=place)) == "r1-3-stream"
    seen = workqueue.RecentIds(limit=2)
    assert seen.add("a") and not seen.add("a") and seen.add("b") and seen.add("c")
    assert len(seen) == 2 and seen.add("a")  # the oldest was forgotten first


def test_a_duplicate_on_the_first_try_was_held_before_one_after_a_retry_may_be_its_own() -> None:
    def stored(duplicate: bool | None, retried: bool) -> workqueue.Stored:
        return workqueue.Stored(PubAck(stream="s", seq=1, duplicate=duplicate), retried=retried)

    assert stored(True, retried=False).held_before
    assert not stored(True, retried=True).held_before  # its first copy's PubAck may have been lost
    assert not stored(False, retried=False).held_before and not stored(None, retried=True).held_before


def test_withdrawing_a_prefill_names_its_phase_and_attempt_on_each_worker() -> None:
    req = InferenceRequest(request_id="r1", model="m", prompt_tokens=[1], block_hashes=[], attempt=2,
                           sampling=SamplingParams(max_tokens=1), reply_subject="x", arrival_ts=0.0)
    pre = WorkItem(request=req, phase=Phase.PREFILL, placement=Placement(mode="disaggregated", decode_worker="d",
                                                                        prefill_worker="p"))
    got = [(c.request_id, c.worker_id, c.phase, c.attempt) for c in workqueue.withdrawals(pre)]
    assert got == [("r1", "p", Phase.PREFILL, 2), ("r1", "d", Phase.DECODE, 2)]
