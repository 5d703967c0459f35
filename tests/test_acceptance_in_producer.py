"""Evaluation where the target lives: producer 0 evaluates the drafters the trainer exports, between its batches."""

from __future__ import annotations

import json
import os
import subprocess
from collections import Counter

from common.faults import LOG_ENV, PLAN_ENV
from common.rundir import RunDir, read_json
from tests.test_pipeline import ONE_PRODUCER, ROOT, SMALL, finish, lineage, start

EVAL = [
    "eval.every_steps=8",
    "eval.num_prompts=2",
    "eval.max_new_tokens=8",
    "logging.log_every=4",
    "eval.producer_share=1.0",
]


def assert_nothing_trained_twice(run: RunDir) -> None:
    """The ledger's lineage trains no (producer, epoch, sample) twice (these runs are shorter than 2 epochs)."""
    triples = Counter(tuple(t) for line in lineage(run) for t in line["samples"])
    assert triples and not [t for t, n in triples.items() if n > 1]


def evaluations(run: RunDir) -> list[dict]:
    return [m for m in (json.loads(line) for line in run.metrics.read_text().splitlines()) if "eval/tau" in m]


def test_producer_zero_evaluates_and_the_trainer_logs_each_result_at_its_step(short_tmp):
    run_dir = short_tmp / "run"
    finish(start(run_dir, "training.max_steps=24", *EVAL, "eval.gap_tolerance=1e-6"), run_dir)
    run = RunDir(run_dir)
    assert [m["step"] for m in evaluations(run)] == [8, 16, 24], "each result at the step whose weights it measured"
    assert all(1.0 <= m["eval/tau"] <= 4.0 and m["eval/num_prompts"] == 2 for m in evaluations(run))
    producer_log = (run_dir / "logs" / "producer-0.log").read_text()
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert (
        producer_log.count("evaluated step") == 3
        and "evaluated step" not in (run_dir / "logs" / "producer-1.log").read_text()
    )
    assert producer_log.count("(loading the export ") == 3, "each evaluation's time split into its phases"
    assert "eval at step 8 (logged at" in trainer_log
    assert "evaluation failed" not in trainer_log + producer_log
    # The target's half was made once, while the ring was full and before anything was asked: no evaluation ran
    # a target forward.
    assert producer_log.count("evaluation reference:") == 1
    assert producer_log.index("evaluation reference:") < producer_log.index("evaluated step")
    assert [m["eval/reference_seconds"] for m in evaluations(run)] == [0.0, 0.0, 0.0]
    # The decoupled trainer warns of a real/simulated gap too: once for every result past the tolerance.
    gaps = [abs(m["eval/tau_gap"]) > 1e-6 * (4 - 1) for m in evaluations(run)]
    assert trainer_log.count("differ by more than eval.gap_tolerance") == sum(gaps)
    # The exports were only for the evaluations: their weights are gone, the results stay.
    assert (
        not list((run_dir / "evals").glob("step-*/drafter"))
        and len(list((run_dir / "evals").glob("step-*/result.json"))) == 3
    )
    assert read_json(run.trainer_status)["evals_in_flight"] == []
    assert_nothing_trained_twice(run)


def test_a_producer_killed_during_an_evaluation_loses_the_evaluation_never_data(short_tmp):
    """kill -9 of producer 0 while it evaluates: the launcher restarts it, that evaluation is reported lost,
    the next ones come back, and the ledger holds every sample once."""
    run_dir = short_tmp / "run"
    fault_log = short_tmp / "faults.jsonl"
    env = {**os.environ, PLAN_ENV: "producer.evaluate:1", LOG_ENV: str(fault_log)}
    finish(start(run_dir, "training.max_steps=32", *EVAL, env=env), run_dir, timeout=300)
    run = RunDir(run_dir)
    assert len(fault_log.read_text().splitlines()) == 1, "the fault fired"
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert "evaluation of step 8 lost: the producer evaluating it was restarted" in trainer_log
    steps = [m["step"] for m in evaluations(run)]
    assert 8 not in steps and 32 in steps
    assert "producer-0 crashed" in (run_dir.parent / "launcher.out").read_text()
    assert_nothing_trained_twice(run)


def test_a_trainer_killed_during_its_export_loses_that_evaluation_and_leaves_no_weights_behind(short_tmp):
    """kill -9 of the trainer after its drafter export, before the request: the next trainer writes that
    evaluation as lost (and logs it) and removes the partial export; the later ones come back."""
    run_dir = short_tmp / "run"
    fault_log = short_tmp / "faults.jsonl"
    env = {**os.environ, PLAN_ENV: "trainer.export:1", LOG_ENV: str(fault_log)}
    finish(start(run_dir, "training.max_steps=32", *EVAL, env=env), run_dir, timeout=300)
    run = RunDir(run_dir)
    [fired] = [json.loads(line) for line in fault_log.read_text().splitlines()]
    assert fired["point"] == "trainer.export"
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert (
        "evaluation of step 8 lost: the trainer that asked for it stopped before its export was complete" in trainer_log
    )
    [abandoned] = [p for p in (run_dir / "evals").glob("step-00000008-*") if not (p / "request.json").exists()]
    assert read_json(abandoned / "result.json")["lost"].startswith("the trainer that asked for it stopped")
    assert not list((run_dir / "evals").glob("step-*/drafter")), "no export's weights are left"
    assert 32 in [m["step"] for m in evaluations(run)]
    assert_nothing_trained_twice(run)


def test_evaluations_asked_faster_than_they_run_never_stop_producer_zero(short_tmp):
    """A request every 4 steps, an evaluation that takes longer: producer 0 evaluates the newest, answers the
    others as skipped and makes batches in between (it used to evaluate back to back and make none)."""
    from common.acceptance import records as evals

    run_dir = short_tmp / "run"
    finish(
        start(
            run_dir,
            "training.max_steps=96",
            "eval.every_steps=4",
            "logging.log_every=4",
            "eval.num_prompts=4",
            "eval.max_new_tokens=32",
            "eval.producer_share=0.25",
        ),
        run_dir,
    )
    run = RunDir(run_dir)
    results = [
        evals.AcceptanceResult(**read_json(path)) for path in sorted((run_dir / "evals").glob("step-*/result.json"))
    ]
    skipped = [r.step for r in results if r.lost and r.lost.startswith("skipped")]
    done = [r.step for r in results if not r.lost]
    assert skipped and len(done) >= 2 and 96 in done, (skipped, done)
    after_first = [p for line in lineage(run) if line["step"] > done[0] for p, _ in line["batches"]]
    assert after_first.count(0) >= 0.25 * len(after_first), "producer 0 went on making batches"
    assert_nothing_trained_twice(run)


def test_the_runs_last_evaluation_starts_as_soon_as_training_ends(short_tmp):
    """eval.producer_share paces the evaluations asked during training: after one of E s producer 0 makes batches for
    E (1 - share) / share s. The last step's is asked once training has ended, when nothing needs batches: it starts
    at once (the run's end used to sit idle through that hold, a minute of a 191 s walkthrough)."""
    from common.acceptance import records as evals

    run_dir, share, last = short_tmp / "run", 0.002, 40
    overrides = (f"training.max_steps={last}", "eval.every_steps=8", "eval.num_prompts=2", "eval.max_new_tokens=8")
    finish(start(run_dir, *ONE_PRODUCER, *overrides, f"eval.producer_share={share}"), run_dir)

    def record(step: int, name: str) -> dict:
        [found] = (run_dir / "evals").glob(f"step-{step:08d}-*/{name}.json")
        return read_json(found)

    # Producer 0 takes the newest request it finds when it looks (every EVAL_POLL_S, between batches) and answers
    # the older ones as skipped: which of those asked during training it evaluates first depends on the machine's
    # pace (step 8's was skipped once, step 16 having come before it looked), so the test takes whichever it was.
    results = {step: evals.AcceptanceResult(**record(step, "result")) for step in range(8, last + 1, 8)}
    during = [step for step in results if step < last and not results[step].lost]
    assert during and not results[last].lost, {step: result.lost for step, result in results.items()}
    first = results[during[0]]
    assert not record(during[0], "request")["final"] and record(last, "request")["final"]
    spent = first.finished - record(during[0], "claim")["claimed"]
    held_until = first.finished + spent * (1 - share) / share
    asked = record(last, "request")["requested"]
    assert held_until - asked > 20, "the share's hold outlasts the end of training: the test tells the two apart"
    assert record(last, "claim")["claimed"] - asked < 10, "the last evaluation started as soon as it was asked"


def test_the_progress_line_says_what_the_runs_last_evaluation_waits_for(tmp_path, capsys):
    """Training over, the line follows producer 0's evaluation (its phase, or what it waits for) with a line per
    change, rather than standing at "evaluating 30" as if the run hung."""
    from common.rundir import atomic_write_json
    from launch.progress import ProgressView

    run = RunDir(tmp_path / "run")
    run.producers.mkdir(parents=True)
    view = ProgressView(run, terminal=False)
    trainer = {"step": 30, "max_steps": 30, "updated": 1000.0, "loss": 2.0, "evals_in_flight": [30]}
    jobs = [
        {"step": None, "doing": None, "held_s": 41.2},
        {"step": None, "doing": None, "held_s": 12.7},  # the hold is for evaluations during training only
        {"step": 30, "doing": "making the target's reference (4 prompts, 48 tokens each)", "held_s": None},
        {"step": 30, "doing": "decoding, 0/4 prompts done", "held_s": None},
        # answered, the trainer not yet at its next look: it read "waiting for producer 0 to start it"
        {"step": None, "answered": 30, "doing": None, "held_s": None},
    ]
    for index, job in enumerate(jobs):
        state = "training" if index == 0 else "final evaluation"
        atomic_write_json(run.trainer_status, {**trainer, "state": state})
        atomic_write_json(run.producers / "p0.json", {"id": 0, "pid": 10, "jobs": {"evaluating": job}})
        view.update(trainer_started_wall=900.0, trainer_alive=True)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 5, lines
    assert "evaluating 30: queued, producer 0 makes batches 41 s more (eval.producer_share)" in lines[0]
    assert "final evaluation" in lines[1] and "evaluating 30: waiting for producer 0 to start it" in lines[1]
    assert "evaluating 30: making the target's reference" in lines[2]
    assert "evaluating 30: decoding, 0/4 prompts done" in lines[3]
    assert "evaluating 30: done, the trainer reads its result" in lines[4]


def test_the_export_for_an_evaluation_is_written_in_the_background_from_a_host_copy(tmp_path):
    """Training changes the weights right after the request: the export holds the step's weights all the same,
    the request comes only once the export is whole, and an export that cannot be written is a lost evaluation."""
    import torch

    from common.acceptance import records as evals
    from common.drafter.export import load_drafter
    from common.drafter.loss import LossConfig
    from common.drafter.model import DFlashDrafter
    from tests.drafter_fixtures import random_head, tiny_config
    from trainer.checkpoint import EvalExportWriter

    run = RunDir(tmp_path / "run")
    config = tiny_config()
    drafter = DFlashDrafter(config, random_head(config), LossConfig())
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    writer = EvalExportWriter(run)
    export = evals.folder(run, 8, 1) / "drafter"
    writer.export(drafter, drafter.state_dict(), evals.AcceptanceRequest(step=8, drafter=str(export), incarnation=1))
    with torch.no_grad():  # the next optimizer step, while the export is written
        for p in drafter.parameters():
            p.add_(1.0)
    writer.wait()
    assert [r.step for r in evals.open_requests(run)] == [8]
    loaded = load_drafter(export, random_head(config), LossConfig(), own_checkpoint=True).state_dict()
    assert all(torch.equal(loaded[k], before[k]) for k in before if k in loaded)

    blocked = evals.folder(run, 16, 1)
    blocked.mkdir(parents=True)
    (blocked / "drafter").write_text("a file where the export's folder goes")
    writer.export(
        drafter, drafter.state_dict(), evals.AcceptanceRequest(step=16, drafter=str(blocked / "drafter"), incarnation=1)
    )
    writer.wait()
    assert evals.result(run, 16, 1).lost.startswith("the export could not be written")
    assert [r.step for r in evals.open_requests(run)] == [8]


def test_the_trainer_warns_when_a_result_shows_a_real_and_simulated_gap(tmp_path, caplog):
    """The result of producer 0 goes through the trainer's own logging, which warns past eval.gap_tolerance."""
    from common.config import load_config
    from common.rundir import RunDir
    from trainer.acceptance import AcceptanceClient

    metrics_file = open(tmp_path / "metrics.jsonl", "w")
    client = AcceptanceClient(
        RunDir(tmp_path),
        incarnation=1,
        block_size=4,
        gap_tolerance=load_config(None).eval.gap_tolerance,
        background_export=False,
        metrics_file=metrics_file,
        wandb_run=None,
    )

    def record(step: int, metrics: dict) -> None:
        client.record(step, metrics, now_step=30)

    with caplog.at_level("WARNING"):
        record(24, {"eval/tau": 1.2, "eval/sim_tau": 2.6, "eval/tau_gap": -1.4})
        assert "differ by more than eval.gap_tolerance" in caplog.text  # 1.4 > 0.3 * (B - 1)
        caplog.clear()
        record(28, {"eval/tau": 2.5, "eval/sim_tau": 2.6, "eval/tau_gap": -0.1})
        assert "differ by more" not in caplog.text
        # With the gap's three steps measured, the warning says which step it is.
        record(
            32,
            {
                "eval/tau": 1.2,
                "eval/sim_tau": 2.6,
                "eval/tau_gap": -1.4,
                "eval/sim_tau_greedy": 1.4,
                "eval/sim_tau_walk": 1.25,
            },
        )
        assert "-1.400 in all, of it -1.200 the documents against the target's own text" in caplog.text
        assert "-0.150 the anchors decoding starts its blocks at" in caplog.text and "-0.050 serving" in caplog.text
    metrics_file.close()
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [24, 28, 32]
    assert client.last == {"step": 32, "tau": 1.2, "sim_tau": 2.6}


def test_a_new_trainer_adopts_the_evaluations_of_its_lineage_and_asks_again_past_it(short_tmp):
    """Two kill -9 of the trainer. The first, at step 10, after evaluations were asked for at steps 4 and 8 and
    the checkpoint of step 8: its successor resumes at 8 and logs those results itself when they come (each
    step's once). The second, at step 14, after an evaluation at step 12 and before the checkpoint of step 16:
    the next trainer resumes at 8 again, the step-12 request of weights its lineage never had is written off,
    and it asks at step 12 anew and gets its own result, not the old one. Nothing is left unanswered."""
    run_dir = short_tmp / "run"
    fault_log = short_tmp / "faults.jsonl"
    env = {**os.environ, PLAN_ENV: "trainer.step:10,trainer.step:6", LOG_ENV: str(fault_log)}
    # Checkpoints and exports written before the step goes on: a background write of step 8's checkpoint can
    # still be in flight at step 10 (the kill then resumes the successor at 0, and no lineage asks at 12 twice).
    with open(run_dir.parent / "launcher.out", "w") as out:
        launcher = subprocess.Popen(
            [
                str(ROOT / "launch" / "run_all.sh"),
                "--run-dir",
                str(run_dir),
                *SMALL,
                "training.max_steps=24",
                *EVAL,
                "eval.every_steps=4",
                "training.async_checkpoint=false",
            ],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    finish(launcher, run_dir, timeout=300)
    run = RunDir(run_dir)
    assert len(fault_log.read_text().splitlines()) == 2, "both faults fired"
    folders = sorted((run_dir / "evals").glob("step-*"))
    assert not [f for f in folders if (f / "drafter").exists()], "no export left waiting for an evaluation"
    assert all((f / "result.json").is_file() and (f / "logged").is_file() for f in folders), (
        "every request answered and seen"
    )
    by_step = Counter(m["step"] for m in evaluations(run))
    assert by_step[4] == 1 and by_step[8] == 1, "the first successor's own lineage: each result logged once"
    asked_at_12 = [f for f in folders if f.name.startswith("step-00000012-")]
    assert len(asked_at_12) == 2, "asked at step 12 by both lineages, each its own request"
    results_12 = [read_json(f / "result.json") for f in asked_at_12]
    assert sum(1 for r in results_12 if not r["lost"]) >= 1 and all(
        r["incarnation"] == int(f.name.rsplit("-", 1)[1]) for r, f in zip(results_12, asked_at_12)
    )
    assert 24 in by_step
    assert_nothing_trained_twice(run)


def test_no_evaluation_reference_is_made_ahead_for_a_run_that_never_reaches_an_evaluation():
    from common.config import load_config
    from producer.acceptance.job import evaluations_expected

    assert evaluations_expected(load_config(None, ["eval.every_steps=10", "training.max_steps=20"]))
    assert not evaluations_expected(load_config(None, ["eval.every_steps=300", "training.max_steps=40"]))
    assert not evaluations_expected(load_config(None, ["eval.every_steps=0"]))
    assert evaluations_expected(load_config(None, ["eval.every_steps=300", "training.max_steps=0"]))  # from epochs
