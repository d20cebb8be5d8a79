"""A run that fails on the twin run's file is nondet's set-up, not the script (trial
h-realtf3: ``Dataset.cache("train_cache")`` in both runs at once was "the script failed in run
a" though the script runs fine alone)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nondet import channel
from nondet.errors import NondetError, ScriptFailed
from nondet.runspec import RunResult
from nondet.schedule import check_result

# The end of run a's log in the trial (TensorFlow 2.21, Keras 3 fit over a cached dataset).
TF_CACHE_LOG = """\
  File "/tmp/rtf4/misc4.py", line 60, in <module>
    model.fit(tr, validation_data=va, epochs=3, verbose=0)
tensorflow.python.framework.errors_impl.AlreadyExistsError: Graph execution error:

There appears to be a concurrent caching iterator running - cache lockfile already exists \
('train_cache_0.lockfile'). If you are sure no other running TF computations are using this \
cache prefix, delete the lockfile and re-initialize the iterator. Lockfile contents: Created \
at: 1795539278
\t [[{{node IteratorGetNext}}]] [Op:__inference_multi_step_on_iterator_2053]
"""


def _failed(tmp_path: Path, log: str) -> RunResult:
    path = tmp_path / "run-a.log"
    path.write_text(log)
    return RunResult(label="a", path=tmp_path / "run-a.h5", log_path=path,
                     status=channel.FAILED, exit_code=1, steps=0)


def test_a_tf_cache_the_twin_run_holds_is_not_the_scripts_failure(tmp_path: Path) -> None:
    with pytest.raises(NondetError) as raised:
        check_result(_failed(tmp_path, TF_CACHE_LOG))
    assert not isinstance(raised.value, ScriptFailed)
    message = str(raised.value)
    assert "tf.data cache 'train_cache'" in message and "working directory" in message
    assert "the script failed" not in message
    assert "--schedule sequential" in message  # what works without changing the script


def test_any_other_failure_is_still_the_scripts(tmp_path: Path) -> None:
    log = "Traceback (most recent call last):\nValueError: bad shape\n"
    with pytest.raises(ScriptFailed, match="the script failed in run a"):
        check_result(_failed(tmp_path, log))


# The end of run a's log in PyTorch round 14: the DDP tutorial's mp.spawn with a fixed
# MASTER_PORT, both runs at once.
PORT_LOG = """\
  File "/tmp/s/mpspawn_ddp.py", line 20, in worker
    dist.init_process_group("gloo", rank=rank, world_size=2)
torch.distributed.DistNetworkError: The server socket has failed to listen on any local \
network address. port: 29814, useIpv6: false, code: -98, name: EADDRINUSE, message: address \
already in use
"""


def test_a_port_the_twin_run_holds_is_named_with_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(NondetError) as raised:
        check_result(_failed(tmp_path, PORT_LOG))
    assert not isinstance(raised.value, ScriptFailed)
    message = str(raised.value)
    assert "(29814) was in use" in message and "--schedule sequential" in message
