"""Shared fixtures: both kernel implementations, and real server processes."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

import aps
from aps import _core, _reference
from aps.testing.drivers import DRIVERS, connect

settings.register_profile(
    "aps",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("ci", parent=settings.get_profile("aps"), print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "aps"))

_runtime_dir: str | None = None

#: .ci/run runs the suites against the installed wheel (APS_TESTS_INSTALLED=1, from a directory
#: outside the checkout, `--import-mode=append`): the package must then come from the virtual
#: environment's site-packages, never from the checkout beside the tests.
CHECKOUT = Path(__file__).resolve().parents[1]


def _check_installed() -> None:
    if os.environ.get("APS_TESTS_INSTALLED"):
        for module in (aps, _core):
            where = Path(module.__file__ or "").resolve()
            if where.is_relative_to(CHECKOUT / "aps"):  # (the environment may lie in the checkout: .venv)
                raise pytest.UsageError(
                    f"APS_TESTS_INSTALLED is set, yet {module.__name__} comes from the checkout ({where}), "
                    "not the installed wheel: run pytest from outside the checkout with --import-mode=append"
                )

#: The longest scenarios of the main suite that run in the slow call instead (``-m slow``), so
#: the main suite stays under 8 minutes on the project's 2-core machine: most are one variant
#: of a scenario whose sibling stays in the main suite (another transport, driver or policy),
#: the others whole scenarios that take 5-14 s each. Nothing is dropped: .ci/run runs both calls.
SLOW_IN_THE_MAIN_SUITE = {
    "tests/integration/test_huggingface.py::test_a_trainer_checkpoint_carries_the_servers_state_and_resumes_exactly",
    "tests/integration/test_huggingface.py::test_the_trainer_with_an_aps_optimizer_equals_its_own_sgd",
    "tests/integration/test_replicas.py::test_killed_primaries_lose_no_acknowledged_update_and_apply_none_twice"
    "[asp-tcp-0]",
    "tests/integration/test_lightning.py::test_a_checkpoint_carries_the_servers_state_and_resumes_exactly",
    "tests/integration/test_lightning.py::test_one_bsp_worker_equals_lightning_with_its_own_sgd"
    "[accumulated-and-clipped]",
    "tests/integration/test_sharded_resume.py::test_a_sharded_bsp_run_equals_the_unsharded_one_across_a_shard_crash"
    "[shm-blocking]",
    "tests/integration/test_sharded_resume.py::test_a_sharded_bsp_run_equals_the_unsharded_one_across_a_shard_crash"
    "[tcp-asyncio]",
    *(
        "tests/integration/test_sharded_resume.py::"
        f"test_a_shard_resumed_from_an_older_checkpoint_makes_no_shard_apply_an_iteration_twice[{variant}]"
        for variant in ("shm-bsp", "tcp-ssp", "tcp-asp", "shm-asp", "shm-ssp")
    ),
    "tests/unit/lab/test_virtual.py::test_the_same_seed_gives_identical_curves_and_another_does_not",
    "tests/unit/lab/test_virtual.py::test_an_experiment_runs_every_cluster_of_its_preset",
    "tests/integration/test_resume_guard.py::test_a_checkpoint_is_signed_with_the_runs_token_and_a_forged_one_is_refused",
    "tests/integration/test_torch.py::test_p_bsp_workers_equal_large_batch_torch_sgd[shm]",
    "tests/integration/test_torch.py::test_a_sharded_model_trains_as_the_unsharded_one[tcp]",
    "tests/unit/test_stub.py::test_stubtest",
    "tests/unit/test_packaging.py::test_requires_python_is_what_the_code_needs",
    "tests/integration/test_clean_exit.py::test_a_torch_script_whose_optimizer_is_local_to_main_has_left_when_main_returns",
    "tests/integration/test_shards.py::test_shards_resumed_from_different_runs_are_told_apart",
    "tests/integration/test_shards.py::test_an_asyncio_sharded_bsp_run_equals_the_unsharded_one",
    "tests/integration/test_shards.py::test_a_sharded_bsp_run_equals_the_unsharded_one[3]",
    "tests/integration/test_shards_netns.py::test_sharded_bsp_across_hosts_equals_one_server",
    "tests/integration/test_cli.py::test_bench_runs_and_writes_json",
    "tests/integration/test_cli.py::test_bench_measures_what_applying_gradients_while_they_arrive_is_worth",
    "tests/integration/test_cli.py::test_status_without_a_token_names_its_flags",
    "tests/integration/test_durability.py::test_conflicting_flags_and_bad_checkpoints_refuse_to_start",
    "tests/integration/test_durability.py::test_interrupted_and_resumed_equals_uninterrupted_bit_for_bit[adam]",
    "tests/integration/test_durability.py::test_interrupted_and_resumed_equals_uninterrupted_bit_for_bit[dc-adaptive]",
    "tests/integration/test_stalls.py::test_a_frozen_worker_is_dropped_and_the_others_go_on[64MiB-tcp-bsp]",
    "tests/integration/test_stalls.py::test_a_frozen_worker_is_dropped_and_the_others_go_on[64MiB-tcp-ssp]",
    "tests/integration/test_dashboard.py::test_each_embedding_table_shows_its_rows_held_and_rows_per_second",
    "tests/integration/test_dashboard.py::test_the_dashboard_asks_for_the_token_or_takes_it_from_the_address",
    "tests/integration/test_dashboard.py::test_a_failing_checkpoint_is_an_alarm_on_the_dashboard",
    "tests/integration/test_dashboard.py::test_what_the_workers_log_is_drawn_per_rank_with_their_processes",
    "tests/integration/test_membership.py::test_a_killed_worker_leaves_at_once_and_nobody_waits_for_it[shm]",
    "tests/integration/test_membership.py::test_a_waiting_worker_says_who_is_missing[shm]",
    "tests/integration/test_membership.py::"
    "test_a_push_whose_connection_was_found_lost_before_it_went_out_says_the_weights_it_was_computed_on[shm]",
    "tests/integration/test_membership.py::"
    "test_a_push_whose_connection_was_found_lost_before_it_went_out_says_the_clock_it_was_computed_in[shm]",
    "tests/integration/test_example_dlrm.py::test_dlrm_under_asp_learns_the_clicks",
    "tests/integration/test_auth.py::test_parallel_guesses_take_their_turns",
    "tests/integration/test_checkpoint_alarm.py::"
    "test_a_disk_that_fills_after_some_checkpoints_says_how_old_the_last_good_one_is",
    "tests/integration/test_rows.py::test_the_servers_memory_follows_the_rows_touched[shm]",
    "tests/integration/test_rows.py::test_three_shards_equal_one_under_bsp[blocking-shm]",
    "tests/integration/test_elastic_sampler.py::test_counters_are_kept_in_checkpoints",
    # (9 to 12 s each on a slow day; their other transport or policy stays in the main suite)
    "tests/integration/test_paradigms.py::test_a_fast_worker_runs_ahead_within_the_bounds[tcp-dssp-1-4]",
    "tests/integration/test_paradigms.py::test_a_fast_worker_runs_ahead_within_the_bounds[tcp-ssp-2]",
    "tests/integration/test_membership.py::test_a_killed_worker_leaves_at_once_and_nobody_waits_for_it[tcp]",
    "tests/integration/test_membership.py::test_rejoin_under_the_same_rank_resumes_at_the_slowest_clock[shm]",
    "tests/integration/test_sharded_resume.py::"
    "test_a_shard_resumed_from_an_older_checkpoint_makes_no_shard_apply_an_iteration_twice[tcp-bsp]",
    "tests/integration/test_sharded_resume.py::test_a_sharded_bsp_run_equals_the_unsharded_one_across_a_shard_crash"
    "[tcp-blocking]",
    "tests/integration/test_durability.py::test_interrupted_and_resumed_equals_uninterrupted_bit_for_bit"
    "[delayed-nesterov]",
    "tests/integration/test_streaming.py::"
    "test_a_shard_killed_and_resumed_mid_run_leaves_both_ranks_training_in_step[older]",
    "tests/integration/test_local_sgd.py::"
    "test_dynamic_local_updates_give_a_slow_worker_fewer_steps_so_both_sync_about_as_often[asp-fixed]",
    "tests/integration/test_limits.py::test_slow_and_silent_peers_are_closed_at_the_handshake_deadline[shm]",
    "tests/integration/test_torch_optim.py::test_schedulers_with_param_groups_equal_torch_optim_exactly[LambdaLR]",
    "tests/integration/test_torch_like.py::test_the_torch_optim_call_trains_as_torch_optim_does[shm]",
    "tests/integration/test_paradigms.py::test_a_fast_worker_runs_ahead_within_the_bounds[shm-dssp-1-4]",
    "tests/integration/test_rows.py::test_three_shards_equal_one_under_bsp[blocking-tcp]",
    *(
        f"tests/integration/test_second_user.py::test_an_impostor_on_a_dead_servers_port_trains_none_of_its_workers[{v}]"
        for v in ("kill-SHUTTING_DOWN", "sigint-LAYOUT_MISMATCH", "sigint-server", "sigint-SHUTTING_DOWN")
    ),
    "tests/integration/test_optimizer_state.py::"
    "test_a_sharded_worker_reads_the_whole_state_and_loads_each_shard_its_range[shm]",
    "tests/integration/test_torch_optim.py::test_state_dict_is_torch_optims_and_restarts_a_run_exactly[shm-adam]",
    "tests/unit/checkpoint/test_manifest.py::test_every_flipped_bit_of_a_real_manifest_is_refused_or_changes_nothing",
    "tests/unit/wire/test_tokens.py::test_random_tokens_of_128_bits_and_more_pass[hex-32]",
    "tests/integration/test_shards.py::test_servers_that_are_not_the_shards_of_one_model_are_refused",
    "tests/integration/test_shards.py::test_status_shows_every_shard",
    "tests/integration/test_http.py::test_each_table_is_watched_in_the_metrics_the_api_and_aps_status",
    "tests/integration/test_elastic.py::test_a_worker_whose_assigned_rank_was_taken_while_it_reconnected_takes_another",
    "tests/unit/lab/test_simulate.py::test_cli_json_has_the_documented_fields",
    "tests/integration/test_tables.py::test_the_guides_pytorch_script_runs_as_written",
    "tests/integration/test_resume_guard.py::"
    "test_a_worker_refuses_a_server_of_its_run_that_its_last_server_did_not_lead_to",
}


@pytest.hookimpl(tryfirst=True)  # (before -m selects by marker)
def pytest_collection_modifyitems(config, items):
    for item in items:
        # (the id from the root: pytest names a test from the directory it runs in, which is
        # outside the checkout when the suite runs against the installed wheel)
        test_id = item.path.relative_to(config.rootpath).as_posix() + item.nodeid[item.nodeid.index("::") :]
        if test_id in SLOW_IN_THE_MAIN_SUITE:
            item.add_marker(pytest.mark.slow)


def pytest_configure(config):
    """Give this test process (each pytest-xdist worker has its own) a private runtime
    directory: the servers it starts put their Unix sockets there ($XDG_RUNTIME_DIR), so
    one process's socket sweep never meets another's servers, whatever runs beside it."""
    _check_installed()
    global _runtime_dir
    if _runtime_dir is None:
        _runtime_dir = tempfile.mkdtemp(prefix=f"aps-tests-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-")
        os.environ["XDG_RUNTIME_DIR"] = _runtime_dir
    try:
        # What torch imports at the first optimizer made (torch._dynamo: some 900 modules,
        # seconds on a loaded machine), imported before any test starts a server: made inside
        # a test, after aps.torch.Optimizer has connected, it can outlast the handshake deadline.
        import torch._dynamo  # noqa: F401
    except ImportError:
        pass


def pytest_unconfigure(config):
    global _runtime_dir
    if _runtime_dir is not None:
        shutil.rmtree(_runtime_dir, ignore_errors=True)
        _runtime_dir = None


@pytest.fixture(params=[_core, _reference], ids=["native", "reference"])
def kernels(request):
    """The native module and its plain-Python twin: every test using this runs on both."""
    return request.param


@pytest.fixture(params=["tcp", "shm"])
def transport(request):
    """Both worker transports: every test using this runs over TCP and over shared memory."""
    return request.param


@pytest.fixture
def server_process():
    """Factory for real ``aps serve`` processes; every one started is stopped at teardown."""
    from aps.testing import ServerProcess

    started: list[ServerProcess] = []

    def start(*args: str, env: dict[str, str] | None = None) -> ServerProcess:
        proc = ServerProcess(*args, env=env)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()


@pytest.fixture
def network():
    """A ``aps.testing.netns.Network`` of separate hosts (skips where namespaces are unusable);
    its processes and namespaces are gone after the test, whatever happened."""
    from aps.testing.netns import Network, require_netns

    require_netns()
    with Network() as net:
        yield net


@pytest.fixture(params=DRIVERS, ids=[f"{driver}-{transport}" for driver, transport in DRIVERS])
def client(request):
    """Both drivers of the worker, over every transport each speaks: ``client(address, rank,
    num_workers, **options)`` is an :class:`aps.Worker`, or an :class:`aps.AsyncWorker` called
    the same way (:class:`aps.testing.drivers.AsyncDriven`); ``client.transport`` and
    ``client.driver`` say which. Every test using this runs its one body over all of them."""
    driver, transport = request.param

    def make(address, rank=0, num_workers=1, **options):
        return connect(driver, address, rank, num_workers, options.pop("transport", transport), **options)

    make.driver, make.transport = driver, transport
    return make
