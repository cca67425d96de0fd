"""The live dashboard in a real browser: headless Chromium (Debian's ``chromium`` and
``chromium-driver``, driven by Selenium) watches a real server while two real worker
processes train a CNN under SSP.

Skipped, with the reason, when the browser is not installed (``.ci/run`` installs it).
Set ``APS_DASHBOARD_SCREENSHOT=PATH`` to keep the screenshot (the README's is one).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from aps.testing import ServerProcess, wait_for

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[test]')")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture
def browser(tmp_path_factory):
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("headless Chromium is not installed (apt-get install chromium chromium-driver)")
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1440,1000", "--no-first-run", "--disable-extensions"):
        options.add_argument(argument)
    # a profile of its own (its storage, its lock): browsers of tests running beside it never meet
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def workers(address: str, count: int, slowdown: list[float], logs) -> list[subprocess.Popen]:
    """Real training processes: the built-in example (a CNN on the digits), paced."""
    procs = []
    for rank in range(count):
        env = dict(os.environ, APS_ADDRESS=address, RANK=str(rank), WORLD_SIZE=str(count), OMP_NUM_THREADS="1",
                   APS_STEP_TIME="0.03", APS_SLOWDOWN=str(slowdown[rank]))
        with open(logs / f"worker-{rank}.log", "w") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "aps.workloads", "--dataset", "digits", "--epochs", "50"],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
    return procs


def opened(url: str, server: ServerProcess) -> str:
    """The dashboard's address as its user opens it: with the token in the link when the
    server made its own (its HTTP side needs it; the page takes it out of the address bar)."""
    return f"{url}#token={server.token.decode()}" if server.token_made else url


def wait_until(condition, timeout: float, what: str):
    return wait_for(condition, timeout, what, every=0.1)  # the page updates at most twice a second


def text_of(driver, element_id: str) -> str:
    return driver.execute_script(f"const e = document.getElementById({element_id!r}); return e ? e.textContent : ''")


@pytest.mark.slow  # (many processes, a long run: the slow call of .ci/run)
def test_the_dashboard_follows_two_workers_training_under_ssp(browser, tmp_path):
    server = ServerProcess("--workers", "2", "--sync", "ssp", "--staleness", "2", "--http-port", "0")
    procs: list[subprocess.Popen] = []
    try:
        line = server.proc.stdout.readline()
        assert line.startswith("aps: dashboard on http://127.0.0.1:"), line
        url = line.split(" on ", 1)[1].strip()
        browser.get(opened(url, server))
        wait_until(lambda: browser.execute_script("return document.body.dataset.state") == "live", 15,
                   "the page to connect")
        procs = workers(server.address, 2, [1.0, 2.0], tmp_path)

        def version(workers_alive: bool = True) -> int:
            for rank, proc in enumerate(procs if workers_alive else []):  # a dead worker moves nothing: say so now
                if proc.poll() is not None:
                    log = (tmp_path / f"worker-{rank}.log").read_text()[-2000:]
                    raise AssertionError(f"worker {rank} exited with {proc.returncode}:\n{log}")
            text = text_of(browser, "version").strip().replace(",", "")
            return int(text) if text.isdigit() else -1

        first = wait_until(lambda: version() > 0 and version(), 90, "the first update to show")
        wait_until(lambda: version() >= first + 20, 60, "the version shown to increase")
        ranks = wait_until(
            lambda: sorted(browser.execute_script(
                "return [...document.querySelectorAll('#workers tr[data-rank]')].map(r => r.dataset.rank)")) == ["0", "1"],
            10, "both ranks in the workers table")
        assert ranks
        assert "lr" in browser.execute_script("return [...document.querySelectorAll('th')].map(h => h.textContent)")
        rates = browser.execute_script(
            "return [...document.querySelectorAll('#workers tr[data-rank]')].map(r => r.cells[13].textContent)")
        assert all(re.fullmatch(r"[0-9.e+-]+(\.\.[0-9.e+-]+)?\*?", rate) for rate in rates), rates  # each rank's lr
        wait_until(lambda: "joined" in text_of(browser, "events"), 10, "the joins in the membership events")
        assert "ssp" in text_of(browser, "config")
        assert "slowest" in browser.execute_script("return document.body.innerText")
        time.sleep(2.5)  # the line charts have a few points
        shot = tmp_path / "dashboard.png"
        assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
        keep = os.environ.get("APS_DASHBOARD_SCREENSHOT")
        if keep:
            shutil.copyfile(shot, keep)
        errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
        assert not errors, errors

        # The server stops: the page says so, clearly, and keeps what it showed.
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        server.stop()
        wait_until(lambda: browser.execute_script("return document.body.dataset.state") == "disconnected", 15,
                   "the page to notice the server stopped")
        banner = browser.find_element("id", "banner")
        assert banner.is_displayed() and "Lost the server" in banner.text and "it stopped" in banner.text
        assert version(workers_alive=False) >= first + 20
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
        server.stop()


def test_the_dashboard_asks_for_the_token_or_takes_it_from_the_address(browser):
    server = ServerProcess("--workers", "1", "--http-port", "0", "--token", "Zq3u9P0vB4h1xkTn7sWc2yLr8GdJ5mEaQiFo6XtKbHw")
    try:
        url = server.proc.stdout.readline().split(" on ", 1)[1].strip()
        # aps serve says how to open the page with the token, and never prints the token
        hint = server._read_first_line(10)  # the next line, or "" after 10 s (bounded: an older server says none)
        assert hint.startswith("aps: the dashboard asks for the server's token") and f"{url}#token=TOKEN" in hint, hint
        assert "Zq3u9P0vB4h1xkTn7sWc2yLr8GdJ5mEaQiFo6XtKbHw" not in hint
        state = lambda: browser.execute_script("return document.body.dataset.state")  # noqa: E731
        browser.get(opened(url, server))
        wait_until(lambda: state() == "login", 15, "the page to ask for the token")
        assert browser.find_element("id", "login").is_displayed()
        assert text_of(browser, "version").strip() in ("", "–")  # nothing shown without it
        # what is empty asks for the token: it does not say there are no workers
        wait_until(lambda: "token" in text_of(browser, "events"), 5, "the events to ask for the token")
        assert browser.execute_script("return document.getElementById('clocks').dataset.empty") == \
            "enter the server's token to see this"
        assert "no workers yet" not in browser.execute_script("return document.body.innerText")
        field = browser.find_element("id", "token")
        field.send_keys("wrong\n")
        wait_until(lambda: state() == "login" and "refused" in text_of(browser, "login-error"), 15,
                   "a wrong token to be refused")
        browser.find_element("id", "token").send_keys("Zq3u9P0vB4h1xkTn7sWc2yLr8GdJ5mEaQiFo6XtKbHw\n")
        wait_until(lambda: state() == "live", 15, "the page to connect with the token")
        wait_until(lambda: text_of(browser, "version").strip() == "0", 10, "the first frame")

        browser.execute_script("sessionStorage.clear()")
        browser.get(url + "#token=Zq3u9P0vB4h1xkTn7sWc2yLr8GdJ5mEaQiFo6XtKbHw")  # a link that carries it
        wait_until(lambda: state() == "live", 15, "the page to connect with the token from the address")
        assert browser.execute_script("return location.hash") == ""  # taken out of the address bar
    finally:
        server.stop()


def test_a_failing_checkpoint_is_an_alarm_on_the_dashboard(browser, tmp_path):
    """The checkpoint directory's disk fills up (a real tmpfs, filled): the page raises the
    alarm with the error, and lowers it once a checkpoint is written again."""
    import numpy as np

    import aps

    from .test_checkpoint_alarm import DISK_BYTES, NUMEL, SmallDisk

    disk = SmallDisk(tmp_path / "disk", DISK_BYTES)
    server = ServerProcess("--workers", "1", "--sync", "asp", "--checkpoint-dir", str(disk.path),
                           "--checkpoint-every", "0.2", "--http-port", "0")
    worker = None
    try:
        url = server.proc.stdout.readline().split(" on ", 1)[1].strip()
        browser.get(opened(url, server))
        wait_until(lambda: browser.execute_script("return document.body.dataset.state") == "live", 15,
                   "the page to connect")
        alarm = browser.find_element("id", "checkpoint-alarm")
        assert not alarm.is_displayed()
        disk.fill()
        worker = aps.Worker(server.address, 0, 1, transport="tcp")
        worker.init({"w": np.zeros(NUMEL, np.float32)})
        grad = {"w": np.ones(NUMEL, np.float32)}

        def shown():
            worker.push(grad)
            return alarm.is_displayed() and "No space left on device" in alarm.text

        wait_until(shown, 20, "the checkpoint alarm")
        assert "Checkpoints are failing" in alarm.text and "since the server started" in alarm.text
        assert browser.execute_script(
            "return document.getElementById('checkpoint').parentElement.dataset.alarm") == "failing"
        assert "failed" in text_of(browser, "checkpoint-detail")
        disk.empty()

        def cleared():
            worker.push(grad)
            return not alarm.is_displayed() and text_of(browser, "checkpoint").endswith("ago")

        wait_until(cleared, 20, "the alarm to end once a checkpoint is written")
        errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
        assert not errors, errors
    finally:
        if worker is not None:
            worker.close()
        server.stop()
        disk.close()


@pytest.mark.slow  # (two servers one after the other, a browser: about 20 s)
def test_one_window_for_the_rates_each_ranks_iterations_and_a_history_kept_across_a_resume(browser, tmp_path):
    """The header's updates/s and the chart's are over one window, said on the page, and
    agree at the same moment; the page shows each rank's iterations/s; and a server resumed
    from its checkpoint (the same run id) keeps the run's history on the page, reload included."""
    import threading

    import numpy as np

    import aps

    stop = threading.Event()

    def train(address: str) -> None:
        with aps.Worker(address, 0, 1, transport="tcp") as worker:
            worker.init({"w": np.zeros(64, np.float32)})
            while not stop.is_set():
                worker.push_pull({"w": np.full(64, 1e-3, np.float32)})
                time.sleep(0.05)

    server = ServerProcess("--workers", "1", "--sync", "asp", "--http-port", "0", "--checkpoint-dir", str(tmp_path))
    resumed = None
    thread = threading.Thread(target=train, args=(server.address,), daemon=True)
    try:
        url = server.proc.stdout.readline().split(" on ", 1)[1].strip()
        http_port = url.rstrip("/").rsplit(":", 1)[1]
        thread.start()
        browser.get(opened(url, server))
        wait_until(lambda: browser.execute_script("return document.body.dataset.state") == "live", 15,
                   "the page to connect")
        wait_until(lambda: int(browser.execute_script("return document.body.dataset.points || '0'")) >= 6, 60,
                   "a few seconds of history")  # (a point a second; on a loaded machine the page may lag)
        header, chart, window, chart_window = browser.execute_script(
            "return ['rate', 'rate-now', 'rate-window', 'chart-rate-window']"
            ".map(id => document.getElementById(id).textContent)")
        assert chart == f"{header} /s" and float(header) > 0, (header, chart)  # one number: one window, one moment
        assert window == "last 10 s" and chart_window == "over the last 10 s"
        iterations = browser.execute_script(
            "return document.querySelector('#workers tr[data-rank=\"0\"]').cells[14].textContent")
        assert float(iterations) > 1, iterations  # a push every 50 ms or so
        assert "iterations/s" in browser.execute_script("return [...document.querySelectorAll('th')].map(h => h.textContent)")
        run_id = text_of(browser, "run-id")
        before = int(browser.execute_script("return document.body.dataset.points"))

        stop.set()
        thread.join(30)
        server.stop()  # a clean stop writes a checkpoint: the resumed server goes on with the run id
        resumed = ServerProcess("--workers", "1", "--sync", "asp", "--http-port", http_port,
                                "--checkpoint-dir", str(tmp_path), "--resume")
        # A page opened after the resume: the history from before is there. (The resumed server
        # made a new token: the page is opened with it, as its user would.)
        browser.get(opened(url, resumed))
        wait_until(lambda: browser.execute_script("return document.body.dataset.state") == "live", 20,
                   "the page to connect to the resumed server")
        # (the socket is live before its first statistics arrive: the run id comes with them)
        wait_until(lambda: text_of(browser, "run-id") == run_id, 15, f"the resumed server's run id {run_id}")
        assert int(browser.execute_script("return document.body.dataset.points")) >= before
        # (a retry while no server listened, between the stop and the resume, is the browser's
        # own network log line: expected here)
        errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"
                  and "ERR_CONNECTION_REFUSED" not in entry["message"]]
        assert not errors, errors
    finally:
        stop.set()
        server.stop()
        if resumed is not None:
            resumed.stop()


def test_each_embedding_table_shows_its_rows_held_and_rows_per_second(browser):
    """A worker pulls and pushes rows of a table: the page shows the table (none before the
    model has one), the rows it holds and their bytes, rows pulled and pushed per second over
    the page's window, and the rows counted, exactly, once the worker stops."""
    import threading

    import numpy as np

    import aps

    stop, moved = threading.Event(), {"pulled": 0, "pushed": 0}

    def train(address: str) -> None:
        with aps.Worker(address, 0, 1, transport="tcp") as worker:
            worker.init({"w": np.zeros(4, np.float32)}, tables={"items": aps.Table(rows=10**9, dim=8)})
            step = 0
            while not stop.is_set():
                ids = np.arange(step % 50 * 20, step % 50 * 20 + 20)  # 1000 distinct ids, over and over
                worker.pull_rows("items", ids)
                worker.push_rows("items", ids[:10], np.full((10, 8), 1e-3, np.float32))
                moved["pulled"] += 20
                moved["pushed"] += 10
                step += 1
                time.sleep(0.01)

    server = ServerProcess("--workers", "1", "--sync", "asp", "--http-port", "0")
    thread = threading.Thread(target=train, args=(server.address,), daemon=True)
    try:
        url = server.proc.stdout.readline().split(" on ", 1)[1].strip()
        browser.get(opened(url, server))
        wait_until(lambda: browser.execute_script("return document.body.dataset.state") == "live", 15,
                   "the page to connect")
        time.sleep(1.0)  # a few frames: no model, no tables, no card
        assert not browser.find_element("id", "tables-card").is_displayed()
        thread.start()
        cells = ("return [...(document.querySelector('#tables tr[data-table=\"items\"]') || {cells: []}).cells]"
                 ".map(c => c.textContent)")
        wait_until(lambda: browser.find_element("id", "tables-card").is_displayed(), 30, "the tables card")
        row = wait_until(lambda: (row := browser.execute_script(cells)) and row[5] not in ("", "–")
                         and float(row[5]) > 0 and row, 30, "rows pulled per second")
        assert row[:3] == ["items", "8", "sgd"] and 0 < int(row[3]) <= 1000 and float(row[6]) > 0
        wait_until(lambda: (row := browser.execute_script(cells)) and float(row[5]) == pytest.approx(
            2 * float(row[6]), rel=0.1), 20, "20 rows pulled for every 10 pushed")  # (once the window holds a few)
        assert text_of(browser, "tables-window") == "rows/s over the last 10 s"
        wait_until(lambda: int(browser.execute_script(cells)[3]) == 500, 30, "every id pushed held")
        stop.set()
        thread.join(30)
        wait_until(lambda: browser.execute_script(cells)[7:9] == [str(moved["pulled"]), str(moved["pushed"])], 10,
                   f"the rows counted: {moved}")
        assert browser.execute_script(cells)[9] == "0"  # none evicted
        assert "B" in browser.execute_script(cells)[4] and " of " in text_of(browser, "tables-total")
        assert text_of(browser, "tables-total").endswith(" held")  # the rows' bytes, of the server's limit
        errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
        assert not errors, errors
    finally:
        stop.set()
        server.stop()


def test_what_the_workers_log_is_drawn_per_rank_with_their_processes(browser, monkeypatch):
    """Two workers log their loss (and one an accuracy) with their batches: the page draws a
    chart per scalar with a line per rank and their newest values, shows each worker's CPU
    use and memory, and warns once the two train on the same batches."""
    import threading

    import numpy as np

    import aps
    from aps.client import logbook

    monkeypatch.setattr(logbook, "LOG_EVERY_S", 0.2)
    stop = threading.Event()

    def train(address: str, rank: int) -> None:
        with aps.Worker(address, rank, 2, transport="tcp") as worker:
            worker.init({"w": np.zeros(4, np.float32)})
            step = 0
            while not stop.is_set():
                worker.push_pull({"w": np.ones(4, np.float32)})
                batch = np.full(16, step % 100, np.float32)  # the same data on both ranks: no sampler
                scalars = {"loss": 2.0 / (1 + step) + rank} | ({"accuracy": step / (step + 10)} if rank else {})
                worker.log(scalars, step=step, batch=batch)
                step += 1
                time.sleep(0.02)

    server = ServerProcess("--workers", "2", "--sync", "asp", "--http-port", "0")
    threads = [threading.Thread(target=train, args=(server.address, rank), daemon=True) for rank in range(2)]
    try:
        url = server.proc.stdout.readline().split(" on ", 1)[1].strip()
        browser.get(opened(url, server))
        wait_until(lambda: browser.execute_script("return document.body.dataset.state") == "live", 15,
                   "the page to connect")
        assert not browser.find_element("id", "training-card").is_displayed(), "nothing logged yet"
        for thread in threads:
            thread.start()
        wait_until(lambda: browser.find_element("id", "training-card").is_displayed(), 30, "the training card")
        charts = ("return Object.fromEntries([...document.querySelectorAll('#curves .curve')].map(c => "
                  "[c.querySelector('canvas').dataset.scalar, [c.querySelector('.curve-ranks').textContent, "
                  "c.querySelector('canvas').dataset.empty || 'drawn']]))")
        shown = wait_until(lambda: (got := browser.execute_script(charts)) and "1:" in got.get("loss", [""])[0]
                           and got, 30, "a chart per scalar, both ranks on the loss")
        assert sorted(shown) == ["accuracy", "loss"]
        assert shown["loss"][0].startswith("rank 0: ") and shown["accuracy"][0].startswith("rank 1: ")
        assert shown["loss"][1] == shown["accuracy"][1] == "drawn"
        cells = "return [...document.querySelectorAll('#workers tr[data-rank]')].map(r => [r.cells[15].textContent, r.cells[16].textContent])"
        wait_until(lambda: all(cpu not in ("", "–") and memory.endswith("B")
                               for cpu, memory in browser.execute_script(cells)), 30, "each worker's CPU and memory")
        box = "const b = document.querySelector('.workers-card .table-box'); return [b.scrollWidth, b.clientWidth]"
        scroll_width, width = browser.execute_script(box)
        assert scroll_width <= width, f"the workers table scrolls sideways at 1440 px ({scroll_width} > {width})"
        warning = wait_until(lambda: browser.find_element("id", "data-warnings").is_displayed()
                             and text_of(browser, "data-warnings"), 30, "the same-data warning")
        assert "ranks 0 and 1 trained on the same batches" in warning
        errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
        assert not errors, errors
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
        server.stop()


@pytest.mark.slow  # (etcd, two replicas and a browser: the slow call)
def test_a_replica_set_running_without_its_backup_is_an_alarm_on_the_dashboard(browser, tmp_path):
    """A primary whose backup is not there (yet): the page shows the set and raises the
    alarm; once the backup holds the whole state, the alarm ends and the set counts two."""
    from aps.testing.etcd import Etcd, etcd_available
    from aps.testing.replicas import ReplicaCluster

    if not etcd_available():
        pytest.skip("etcd (Debian's etcd-server) is not installed")
    with Etcd(tmp_path / "etcd") as etcd:
        cluster = ReplicaCluster(tmp_path / "run", etcd.url, extra=("--http-port", "0"))
        try:
            cluster.start_replica(0)
            cluster.wait_log(0, "primary at term")
            wait_for(lambda: "dashboard on" in cluster.out(0), 10, "the dashboard's address")
            url = cluster.out(0).split("dashboard on ", 1)[1].split()[0]
            browser.get(f"{url}#token={cluster.token}")
            wait_until(lambda: browser.execute_script("return document.body.dataset.state") == "live", 15,
                       "the page to connect")
            alarm = browser.find_element("id", "replica-alarm")
            wait_until(alarm.is_displayed, 15, "the alarm of a set without backups")
            assert "Running without backups" in alarm.text
            assert text_of(browser, "replicas").startswith("1 · term")
            cluster.start_replica(1)
            cluster.wait_log(0, "holds the whole state")
            wait_until(lambda: not alarm.is_displayed(), 15, "the alarm to end")
            assert text_of(browser, "replicas").startswith("2 · term")
            errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
            assert not errors, errors
        finally:
            cluster.close()
