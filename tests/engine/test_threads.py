"""Threads that step: they end when idle (taking their OpenMP workers with them) and come back on new work."""

import threading
import time

import pytest

from tfserve.engine.manager import BatchingManager
from tfserve.engine.threads import WorkThread, run_in_fresh_thread
from tfserve.sampling_params import SamplingParams


def _wait_for(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


class Counter:
    """Work to do: `pending` units, one per step."""

    def __init__(self) -> None:
        self.pending = 0
        self.done = 0
        self.threads: set[str] = set()
        self.stopped = 0

    def step(self) -> None:
        self.threads.add(threading.current_thread().name)
        if self.pending:
            self.pending -= 1
            self.done += 1

    def has_work(self) -> bool:
        return self.pending > 0

    def on_stop(self) -> None:
        self.stopped += 1


def test_run_in_fresh_thread_returns_and_raises():
    caller = threading.get_ident()
    assert run_in_fresh_thread(lambda a, b=0: (a + b, threading.get_ident()), 2, b=3)[0] == 5
    assert run_in_fresh_thread(threading.get_ident) != caller
    with pytest.raises(KeyError, match="missing"):
        run_in_fresh_thread(lambda: {}["missing"])


def test_work_thread_ends_when_idle_and_comes_back():
    work = Counter()
    worker = WorkThread("test-worker", work.step, work.has_work, work.on_stop, linger_s=0.05).start()
    work.pending = 5
    worker.wake()
    assert _wait_for(lambda: work.done == 5)
    assert _wait_for(lambda: not worker.is_alive)  # idle: its thread ended
    assert worker.is_running and worker.num_starts == 1
    work.pending = 3
    worker.wake()
    assert _wait_for(lambda: work.done == 8)
    assert worker.num_starts == 2
    worker.stop()
    assert work.stopped == 1 and not worker.is_running
    worker.stop()  # a second stop is a no-op
    assert work.stopped == 1


def test_work_thread_stop_while_busy_runs_on_stop_on_its_thread():
    stop_threads = []
    gate = threading.Event()

    def step():
        gate.wait(5)

    worker = WorkThread("busy", step, lambda: True, lambda: stop_threads.append(threading.current_thread().name))
    worker.start()
    assert _wait_for(lambda: worker.is_alive)
    worker.stop(block=False)
    gate.set()
    assert _wait_for(lambda: stop_threads == ["busy"])
    assert _wait_for(lambda: not worker.is_alive)


def test_a_failing_step_is_logged_and_later_work_goes_on(caplog):
    work = Counter()

    def step():
        if work.done == 0 and work.pending == 2:
            work.pending -= 1
            raise RuntimeError("boom")
        work.step()

    worker = WorkThread("flaky", step, work.has_work, linger_s=0.05).start()
    work.pending = 2
    worker.wake()
    assert _wait_for(lambda: work.done == 1)
    assert "flaky: step failed" in caplog.text
    worker.stop()


def test_woken_between_idle_checks_is_not_lost():
    """A wake() at the moment the thread decides to end either finds it still looking or starts a new one."""
    work = Counter()
    worker = WorkThread("race", work.step, work.has_work, linger_s=0.0).start()
    for expected in range(1, 200):
        work.pending += 1
        worker.wake()
        assert _wait_for(lambda: work.done == expected, timeout=2.0), f"work {expected} was lost"
    worker.stop()


def test_engine_thread_ends_when_idle_and_serves_the_next_request(make_engine):
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with BatchingManager(make_engine()) as manager:
        first = manager.get_result(manager.add_request([1, 2, 3], params=params), timeout=30)
        assert first is not None and len(first.generated_tokens) == 4
        assert _wait_for(lambda: not manager._worker.is_alive)
        second = manager.get_result(manager.add_request([1, 2, 3], params=params), timeout=30)
        assert second.generated_tokens == first.generated_tokens
        assert manager._worker.num_starts == 2
    assert not manager.is_running


def test_results_are_read_once_and_not_kept_after(make_engine):
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    with BatchingManager(make_engine()) as manager:
        by_id = [manager.add_request([1, 2, 3], params=params) for _ in range(3)]
        for request_id in by_id[:2]:
            assert manager.get_result(request_id, timeout=30).request_id == request_id
        assert list(manager.request_iter(by_id[2]))[-1].finished  # transformers' name for request_id_iter
        assert manager.get_result(timeout=0.2) is None  # nothing unread: not a result already read by its id
        later = manager.add_request([1, 2, 3], params=params, request_id=7)
        assert later == "7"  # an id is a string, as the outputs carry it
        assert manager.get_result(timeout=30).request_id == "7"
        assert not manager._queues and not manager._unread  # nothing kept once read


def test_get_result_without_an_id_leaves_a_read_request_alone(make_engine):
    """A stream being iterated (or a result awaited by its id) is not taken by another thread's get_result():
    the iterator used to wait forever for the final output that thread took."""
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with BatchingManager(make_engine()) as manager:
        taken = []
        waiter = threading.Thread(target=lambda: taken.append(manager.get_result(timeout=5)))
        waiter.start()
        time.sleep(0.05)
        streamed = manager.add_request([1, 2, 3], params=params, stream=True)
        outputs = list(manager.request_iter(streamed))
        assert outputs[-1].finished and len(outputs[-1].generated_tokens) == 8
        other = manager.add_request([1, 2, 3], params=params)
        waiter.join(10)
        assert [output.request_id for output in taken] == [other]  # the next unread one, not the stream
        with pytest.raises(KeyError):
            manager.get_result(streamed)  # read once


def test_one_request_is_read_by_one_thread(make_engine):
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with BatchingManager(make_engine()) as manager:
        request_id = manager.add_request([1, 2, 3], params=params, stream=True)
        outputs = manager.request_iter(request_id)
        with pytest.raises(ValueError, match="another thread"):
            manager.get_result(request_id)
        assert list(outputs)[-1].finished


def test_get_result_times_out_on_time_while_a_stream_goes_on(make_engine):
    """The timeout is for the whole wait, not for each streamed output (it restarted on every token)."""
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    engine = make_engine()
    step = engine.step

    def slow_step():  # a token every 10 ms: each came before the old per-output timeout ran out
        time.sleep(0.01)
        return step()

    engine.step = slow_step
    with BatchingManager(engine) as manager:
        request_id = manager.add_request([1, 2, 3], params=params, stream=True)
        started = time.monotonic()
        assert manager.get_result(request_id, timeout=0.1) is None
        assert time.monotonic() - started < 0.5
        manager.abort(request_id)
        assert manager.get_result(request_id, timeout=30).finished


def test_an_add_racing_a_stop_is_refused_or_aborted_never_lost(make_engine):
    """stop() between an add's check and its queueing left the request queued for ever: no result, no error."""
    manager = BatchingManager(make_engine()).start()
    check = manager._worker.__class__.stopped
    stopper = threading.Thread(target=manager.stop)

    class StopsWhileChecked(type(manager._worker)):
        @property
        def stopped(self):  # the add has looked: now the stop runs (it waits for the add's lock, if it has one)
            was = check.fget(self)
            if not stopper.is_alive() and not was:
                stopper.start()
                time.sleep(0.2)
            return was

    manager._worker.__class__ = StopsWhileChecked
    try:
        request_id = manager.add_request([1, 2, 3], params=SamplingParams(max_tokens=2))
    except RuntimeError:
        request_id = None
    stopper.join(10)
    if request_id is not None:
        result = manager.get_result(request_id, timeout=5)
        assert result is not None and result.finish_reason in ("abort", "length")  # ran before the stop, or not


def test_a_stopped_manager_refuses_requests(make_engine):
    manager = BatchingManager(make_engine()).start()
    manager.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        manager.add_request([1, 2, 3], params=SamplingParams(max_tokens=2))
    manager.start()
    assert manager.get_result(manager.add_request([1, 2, 3], params=SamplingParams(max_tokens=2)), timeout=30)
    manager.stop()


def test_exiting_with_requests_in_flight_exits_cleanly(tmp_path):
    """A script that ends without stop() while the engine thread is mid-step: the thread is stopped at exit (it
    aborted the process: "terminate called without an active exception")."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "script.py"
    script.write_text(f"""import sys, time
sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
from tiny import build_tokenizer, build_llama
from tfserve import Engine, SamplingParams
from tfserve.engine.manager import BatchingManager
tokenizer = build_tokenizer()
manager = BatchingManager(Engine(build_llama(tokenizer), tokenizer, num_blocks=256, block_size=16)).start()
for _ in range(8):
    manager.add_request([5, 6, 7], params=SamplingParams(max_tokens=500, ignore_eos=True))
time.sleep(1)
""")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
