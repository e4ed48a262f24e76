"""The rank process's units alone: how a call's end becomes the supervisor's message (``rank/outcome``).

No cluster: ``outcome`` is given the call and gives back the message, as ``rank/main.run_job`` sends it. The
whole path (rendezvous, call, outcome) runs in every job of the suite.
"""

from __future__ import annotations

import sys
import threading

import cloudpickle
import pytest

from dask_ddp.rank.outcome import outcome
from dask_ddp.wire.errors import RankExitError, RankFailedError, SerializationError
from dask_ddp.wire.messages import Failed, Result


def ended(call, finished=None):
    return outcome(call, 3, "tcp://w3", finish=(lambda: finished.append(True)) if finished is not None else
                   (lambda: None))


def test_a_return_is_a_result_sent_after_finish():
    finished = []
    msg = ended(lambda: {"loss": 0.5}, finished)
    assert isinstance(msg, Result) and cloudpickle.loads(msg.value) == {"loss": 0.5} and finished == [True]


@pytest.mark.parametrize("code", [None, 0])
def test_sys_exit_0_is_success_as_under_torchrun(code):
    msg = ended(lambda: sys.exit(code))
    assert isinstance(msg, Result) and cloudpickle.loads(msg.value) is None


def raised(msg) -> BaseException:
    assert isinstance(msg, Failed), msg
    return cloudpickle.loads(msg.error)


def test_a_failure_keeps_its_type_and_names_rank_and_worker():
    def boom():
        raise ValueError("bad lr")

    finished = []
    msg = ended(boom, finished)
    exc = raised(msg)
    assert type(exc) is ValueError and not msg.secondary and finished == []
    assert "[dask-ddp] raised on rank 3, worker tcp://w3" in "\n".join(exc.__notes__)


def test_other_exits_and_interrupts_become_errors_that_say_so():
    exc = raised(ended(lambda: sys.exit(4)))
    assert isinstance(exc, RankExitError) and exc.code == 4 and exc.rank == 3

    def interrupted():
        raise KeyboardInterrupt

    exc = raised(ended(interrupted))
    assert isinstance(exc, RankFailedError) and "KeyboardInterrupt" in str(exc)  # never the notebook's own Ctrl-C


def test_an_unpicklable_return_is_a_serialization_error_and_does_not_finish():
    finished = []
    exc = raised(ended(threading.Lock, finished))
    assert isinstance(exc, SerializationError) and "cannot be pickled back" in str(exc) and finished == []


def test_a_broken_collective_is_marked_secondary():
    def peer_gone():
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")

    assert ended(peer_gone).secondary
