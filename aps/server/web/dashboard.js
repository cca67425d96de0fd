/*
 * aps live dashboard.
 *
 * Opens the server's WebSocket (path "ws" next to this page), sends the token
 * as the first message, then renders the "hello" and "stats" messages: header
 * numbers, each rank's clock (bar chart and table), what the workers log
 * (worker.log: a chart per scalar, a line per rank), the embedding tables (when
 * the model has any), history line charts, DSSP r* grants, membership events,
 * configuration and traffic. When the socket
 * closes, the data stays on screen, greyed out, and the page retries every 2 s.
 * Redraws are batched into animation frames.
 */
"use strict";

(() => {
  const TOKEN_KEY = "aps-token";
  const WINDOW_S = 600;            // history kept and shown: the last 10 minutes
  const MAX_EVENTS = 200;
  const RETRY_MS = 2000;
  const BUSY_RETRY_MS = 10000;
  const HELLO_TIMEOUT_MS = 10000;  // no hello by then: drop the socket and retry
  const CODE_UNAUTHORIZED = 4401;
  const CODE_BUSY = 4429;
  const CODE_GOING_AWAY = 1001;    // the server is stopping
  const DASH = "–";
  const CURVE_POINTS = 1024;       // a curve keeps at most this many points (then every other one)
  const RANK_COLORS = ["#2f67c8", "#dd7a1f", "#1f8a4c", "#8c63c6", "#c23b32", "#0e8a96", "#a86a00", "#5a6b7f"];

  const $ = (id) => document.getElementById(id);
  const css = getComputedStyle(document.documentElement);
  const COLORS = {};
  for (const name of ["live", "slowest", "held", "gone", "accent", "text", "muted", "grid", "line"]) {
    COLORS[name] = css.getPropertyValue(`--${name}`).trim();
  }
  const FONT = getComputedStyle(document.body).fontFamily;

  const app = {
    token: takeToken(),
    socket: null,
    retryTimer: 0,
    helloTimer: 0,
    closing: null,       // what the server said before closing: {code, text}
    everConnected: false,
    lostAt: null,        // when the connection was lost, while disconnected
    runId: null,
    apsVersion: null,
    config: {},
    server: null,
    workers: [],
    rows: new Map(),     // rank -> <tr> of the workers table
    tableRows: new Map(),  // table name -> <tr> of the embedding tables
    points: [],
    everyS: 1,
    rateWindowS: 10,     // the window of every updates/s shown (the hello says it)
    clockOffset: null,   // server unix time minus browser unix time, estimated from the points
    events: [],
    curves: new Map(),   // scalar name -> Map(rank -> {steps, values}) (worker.log)
    curveCards: new Map(),  // scalar name -> {card, canvas, ranks}
    dataWarnings: [],
    dirty: { config: true, events: true },
  };

  /* ---------- formatting ---------- */

  const isNum = (v) => typeof v === "number" && Number.isFinite(v);
  const isObject = (v) => v !== null && typeof v === "object" && !Array.isArray(v);
  const pad2 = (n) => String(n).padStart(2, "0");
  const fmtInt = (v) => (isNum(v) ? String(Math.round(v)) : DASH);
  const fmtFixed = (v, digits) => (isNum(v) ? v.toFixed(digits) : DASH);

  /** A number as Python's "%g" writes it (6 significant digits, trailing zeros dropped), as `aps status` does. */
  function fmtG(v) {
    if (!isNum(v)) return DASH;
    if (v === 0) return "0";
    const [mantissa, exp] = v.toExponential(5).split("e"), e = Number(exp);
    if (e < -4 || e >= 6) {
      const m = mantissa.replace(/\.?0+$/, "");
      return `${m}e${e < 0 ? "-" : "+"}${String(Math.abs(e)).padStart(2, "0")}`;
    }
    const fixed = v.toFixed(5 - e);
    return fixed.includes(".") ? fixed.replace(/\.?0+$/, "") : fixed;
  }

  /** A worker's learning rate as `aps status` shows it: one value or min..max, `*` when its own. */
  function fmtLr(w) {
    const span = w.lr_range;
    if (!Array.isArray(span) || !isNum(span[0]) || !isNum(span[1])) return DASH;
    const text = span[0] === span[1] ? fmtG(span[0]) : `${fmtG(span[0])}..${fmtG(span[1])}`;
    return w.hyperparameters_own === true ? `${text}*` : text;
  }

  function fmtClockTime(unix) {
    const d = new Date(unix * 1000);
    return `${pad2(d.getHours())}:${pad2(d.getMinutes())}:${pad2(d.getSeconds())}`;
  }

  function fmtDuration(seconds) {
    if (!isNum(seconds)) return DASH;
    const s = Math.max(0, Math.floor(seconds));
    const m = Math.floor(s / 60) % 60, h = Math.floor(s / 3600) % 24;
    if (s < 60) return `${s} s`;
    if (s < 3600) return `${m} min ${pad2(s % 60)} s`;
    return s < 86400 ? `${h} h ${pad2(m)} min` : `${Math.floor(s / 86400)} d ${h} h`;
  }

  function fmtBytes(n) {
    if (!isNum(n)) return DASH;
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return i === 0 ? `${n} B` : `${n.toFixed(n < 10 ? 2 : n < 100 ? 1 : 0)} ${units[i]}`;
  }

  function fmtCount(n) {
    if (!isNum(n) || n < 1e4) return isNum(n) ? String(n) : DASH;
    const [size, unit] = n >= 1e9 ? [1e9, "G"] : n >= 1e6 ? [1e6, "M"] : [1e3, "k"];
    return `${(n / size).toFixed(n / size < 10 ? 2 : 1)} ${unit}`;
  }

  function fmtValue(v) {
    if (v === null || v === undefined || v === "") return DASH;
    if (Array.isArray(v)) return v.map(fmtValue).join(", ");
    return isObject(v) ? JSON.stringify(v) : String(v);
  }

  function setText(id, text, title) {
    const node = $(id);
    if (node.textContent !== text) node.textContent = text;
    if (title !== undefined) node.title = title;
  }

  function el(tag, text, className) {
    const node = document.createElement(tag);
    if (text !== undefined) node.textContent = text;
    if (className) node.className = className;
    return node;
  }

  /* ---------- token ---------- */

  function storeToken(token) {
    try {
      if (token === null) sessionStorage.removeItem(TOKEN_KEY);
      else sessionStorage.setItem(TOKEN_KEY, token);
    } catch (_) { /* storage unavailable */ }
  }

  /** The token from "#token=..." (then removed from the address bar), else from sessionStorage. */
  function takeToken() {
    const match = /(?:^#|[&;])token=([^&;]*)/.exec(location.hash);
    if (match) {
      let token = match[1];
      try { token = decodeURIComponent(token); } catch (_) { /* keep it as written */ }
      storeToken(token);
      history.replaceState(history.state, "", location.pathname + location.search);
      return token;
    }
    try { return sessionStorage.getItem(TOKEN_KEY) || ""; } catch (_) { return ""; }
  }

  /* ---------- connection ---------- */

  function setState(state) {
    document.body.dataset.state = state;
    app.dirty.events = true;  // its empty text follows the state
    scheduleRender();
  }

  function showBanner(text) {
    $("banner").textContent = text;
    $("banner").hidden = !text;
  }

  function dropSocket() {
    clearTimeout(app.helloTimer);
    const socket = app.socket;
    app.socket = null;
    if (socket) socket.close();
  }

  function connect() {
    clearTimeout(app.retryTimer);
    dropSocket();
    app.closing = null;
    const url = new URL("ws", location.href);
    url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
    url.hash = "";
    let socket;
    try { socket = new WebSocket(url.href); } catch (_) { connectionLost(null, RETRY_MS); return; }
    app.socket = socket;
    app.helloTimer = setTimeout(() => { if (app.socket === socket) socket.close(); }, HELLO_TIMEOUT_MS);
    socket.onopen = () => socket.send(JSON.stringify({ token: app.token }));
    socket.onmessage = (ev) => { if (app.socket === socket) handleMessage(ev.data); };
    socket.onclose = (ev) => {
      if (app.socket !== socket) return;  // dropped on purpose
      app.socket = null;
      clearTimeout(app.helloTimer);
      const said = app.closing || { code: ev.code, text: ev.reason };
      if (said.code === CODE_UNAUTHORIZED) showLogin(said.text || "this server needs its token");
      else if (said.code === CODE_BUSY) {
        connectionLost(`The server turned this page away: ${said.text || "too many dashboards open"}. `
          + "Trying again every 10 s.", BUSY_RETRY_MS);
      } else if (app.closing) connectionLost(`The server answered: ${said.text}. Trying again every 2 s.`, RETRY_MS);
      else if (ev.code === CODE_GOING_AWAY && app.everConnected) {
        connectionLost(`Lost the server at ${fmtClockTime(Date.now() / 1000)}: it stopped. `
          + "Trying again every 2 s (a new server on this port is picked up).", RETRY_MS);
      } else connectionLost(null, RETRY_MS);
    };
  }

  function connectionLost(message, retryMs) {
    if (!app.lostAt) app.lostAt = Date.now() / 1000;
    const at = fmtClockTime(app.lostAt);
    showBanner(message || (app.everConnected
      ? `Lost the server at ${at}: it stopped or the network is down. Trying again every 2 s.`
      : `Cannot reach the server (since ${at}): it is not running or the network is down. Trying again every 2 s.`));
    $("login").hidden = true;
    setState("disconnected");
    clearTimeout(app.retryTimer);
    app.retryTimer = setTimeout(connect, retryMs);
  }

  /** The token was refused: ask for another one, and do not retry until it is given. */
  function showLogin(text) {
    dropSocket();
    clearTimeout(app.retryTimer);
    storeToken(null);
    showBanner("");
    $("login-error").textContent = app.token ? `${text}: the token given was refused.` : `${text}.`;
    $("login").hidden = false;
    setState("login");
    $("token").focus();
  }

  function submitLogin(ev) {
    ev.preventDefault();
    app.token = $("token").value;
    $("token").value = "";
    storeToken(app.token);
    $("login").hidden = true;
    setState("connecting");
    connect();
  }

  /* ---------- messages ---------- */

  function handleMessage(raw) {
    let msg;
    try { msg = JSON.parse(raw); } catch (err) { console.warn("aps dashboard: a message is not JSON", err); return; }
    if (!isObject(msg)) return;
    try {
      if (msg.type === "hello") onHello(msg);
      else if (msg.type === "stats") onStats(msg);
      else if (msg.type === "error") onError(msg);
    } catch (err) {
      console.warn("aps dashboard: message not understood", err);
    }
  }

  function onHello(msg) {
    const runId = msg.run_id === undefined || msg.run_id === null ? "" : String(msg.run_id);
    if (app.runId !== null && runId !== app.runId) resetRun();
    else if (app.runId === null) restoreHistory(runId);  // a reload of this run's page keeps its history
    app.runId = runId;
    if (isNum(msg.rate_window_s) && msg.rate_window_s > 0) app.rateWindowS = msg.rate_window_s;
    // the current statistics come with the hello: the first paint is complete
    if (isObject(msg.server)) app.server = msg.server;
    if (Array.isArray(msg.workers)) app.workers = msg.workers.filter((w) => isObject(w) && isNum(w.rank));
    app.apsVersion = typeof msg.aps_version === "string" ? msg.aps_version : null;
    app.config = isObject(msg.config) ? msg.config : {};
    app.dirty.config = true;
    if (isNum(msg.history_every_s) && msg.history_every_s > 0) app.everyS = msg.history_every_s;
    addPoints(msg.history, true);
    addEvents(msg.events);
    setCurves(msg.curves);
    if (Array.isArray(msg.warnings)) app.dataWarnings = msg.warnings;
    clearTimeout(app.helloTimer);
    app.everConnected = true;
    app.lostAt = null;
    showBanner("");
    $("login").hidden = true;
    setState("live");
  }

  function onStats(msg) {
    if (isObject(msg.server)) app.server = msg.server;
    if (Array.isArray(msg.workers)) app.workers = msg.workers.filter((w) => isObject(w) && isNum(w.rank));
    addPoints(msg.points, false);
    addEvents(msg.events);
    addCurvePoints(msg.scalars);
    if (Array.isArray(msg.warnings)) app.dataWarnings = msg.warnings;
    saveHistory();
    scheduleRender();
  }

  /*
   * The history of a run outlives the page and the server process: kept in sessionStorage
   * under the run id, a reload or a server resumed from a checkpoint (same run id, a history
   * of its own from the resume on) shows the points from before too.
   */
  const HISTORY_KEY = "aps-history";
  let savedAt = 0;

  function saveHistory() {
    const now = Date.now();
    if (now - savedAt < 5000 || !app.points.length) return;
    savedAt = now;
    try {
      sessionStorage.setItem(HISTORY_KEY, JSON.stringify({ runId: app.runId, points: app.points }));
    } catch (_) { /* storage full or unavailable: the history is the server's alone */ }
  }

  function restoreHistory(runId) {
    let saved = null;
    try { saved = JSON.parse(sessionStorage.getItem(HISTORY_KEY) || "null"); } catch (_) { saved = null; }
    if (!isObject(saved) || saved.runId !== runId || !Array.isArray(saved.points)) return;
    app.points = saved.points.filter((p) => isObject(p) && isNum(p.t));
  }

  function onError(msg) {
    app.closing = { code: msg.code, text: typeof msg.error === "string" && msg.error ? msg.error : `error ${msg.code}` };
    if (msg.code === CODE_UNAUTHORIZED) showLogin(app.closing.text);
  }

  /** A new server (another run id): forget the old run's data. */
  function resetRun() {
    Object.assign(app, { server: null, workers: [], points: [], events: [], clockOffset: null, dataWarnings: [] });
    app.curves.clear();
    app.curveCards.forEach(({ card }) => card.remove());
    app.curveCards.clear();
    try { sessionStorage.removeItem(HISTORY_KEY); } catch (_) { /* storage unavailable */ }
    app.dirty.events = true;
    app.rows.forEach((row) => row.remove());
    app.rows.clear();
    app.tableRows.forEach((row) => row.remove());
    app.tableRows.clear();
  }

  /** Add history points; a full history (hello) replaces what it overlaps. */
  function addPoints(list, full) {
    const points = Array.isArray(list) ? list.filter((p) => isObject(p) && isNum(p.t)) : [];
    if (!points.length) return;
    if (full) app.points = app.points.filter((p) => p.t < points[0].t);
    const now = Date.now() / 1000;
    for (const p of points) {
      const last = app.points[app.points.length - 1];
      if (!last || p.t > last.t) app.points.push(p);
      // A point is stamped no later than the server's "now": the largest difference is the best estimate.
      if (app.clockOffset === null || p.t - now > app.clockOffset) app.clockOffset = p.t - now;
    }
    const oldest = app.points[app.points.length - 1].t - WINDOW_S;
    const keep = app.points.findIndex((p) => p.t >= oldest);
    if (keep > 0) app.points.splice(0, keep);
  }

  /** The curves the hello brings ({rank: {name: [[step, value], ...]}}): they replace what the page had. */
  function setCurves(curves) {
    if (!isObject(curves)) return;
    app.curves.clear();
    for (const [rank, names] of Object.entries(curves)) {
      if (!isObject(names)) continue;
      for (const [name, points] of Object.entries(names)) {
        if (!Array.isArray(points)) continue;
        for (const p of points) if (Array.isArray(p)) addCurvePoint(name, Number(rank), p[0], p[1]);
      }
    }
  }

  /** The points a frame brings: [seq, rank, name, step, value]. */
  function addCurvePoints(list) {
    if (!Array.isArray(list)) return;
    for (const p of list) if (Array.isArray(p) && p.length === 5) addCurvePoint(p[2], p[1], p[3], p[4]);
  }

  function addCurvePoint(name, rank, step, value) {
    if (typeof name !== "string" || !isNum(rank) || !isNum(step)) return;
    let byRank = app.curves.get(name);
    if (!byRank) { byRank = new Map(); app.curves.set(name, byRank); }
    let curve = byRank.get(rank);
    if (!curve) { curve = { steps: [], values: [] }; byRank.set(rank, curve); }
    curve.steps.push(step);
    curve.values.push(isNum(value) ? value : null);  // (NaN and infinities come as null: a gap)
    if (curve.steps.length > CURVE_POINTS) {  // keep the run's shape: every other point
      curve.steps = curve.steps.filter((_, i) => i % 2 === 0);
      curve.values = curve.values.filter((_, i) => i % 2 === 0);
    }
  }

  const eventKey = (e) => (isNum(e.seq) ? `#${e.seq}` : `${e.t}/${e.rank}/${e.event}`);

  function addEvents(list) {
    if (!Array.isArray(list) || !list.length) return;
    const seen = new Set(app.events.map(eventKey));
    for (const e of list) {
      if (isObject(e) && !seen.has(eventKey(e))) { seen.add(eventKey(e)); app.events.push(e); }
    }
    app.events.sort((a, b) => (isNum(a.seq) && isNum(b.seq) ? b.seq - a.seq : (b.t || 0) - (a.t || 0)));
    app.events.length = Math.min(app.events.length, MAX_EVENTS);
    app.dirty.events = true;
  }

  /* ---------- derived values ---------- */

  const workerState = (w) => (!w.live ? "gone" : w.held ? "held" : "live");

  /**
   * What an empty part of the page says: "no workers yet" only once the server said so;
   * before its first message "loading", and while it waits for the token, that it does.
   */
  function emptyText(text) {
    const state = document.body.dataset.state;
    if (state === "login") return "enter the server's token to see this";
    if (!app.everConnected && state !== "live") return "loading…";
    return text;
  }

  /** "dssp", "ssp", ... or null before the server said. */
  function syncName() {
    const text = (app.server && app.server.sync) || app.config.sync;
    return typeof text === "string" ? text.trim().split(/\s+/)[0] : null;
  }

  /** The live worker with the smallest clock (ties: lowest rank). */
  function slowestRank(workers) {
    let slowest = null;
    for (const w of workers) {
      if (!w.live || !isNum(w.clock)) continue;
      if (!slowest || w.clock < slowest.clock || (w.clock === slowest.clock && w.rank < slowest.rank)) slowest = w;
    }
    return slowest ? slowest.rank : null;
  }

  const histEntries = (hist) => (isObject(hist) ? Object.entries(hist).filter(([, n]) => isNum(n)) : []);
  const rStarGrants = (hist) => histEntries(hist).reduce((sum, [, n]) => sum + n, 0);

  /* ---------- rendering ---------- */

  let renderPending = false;

  function scheduleRender() {
    if (renderPending) return;
    renderPending = true;
    requestAnimationFrame(() => {
      renderPending = false;
      for (const part of [renderHeader, renderWorkers, renderTraining, renderTables, renderHistory, renderRStar, renderEvents,
        renderConfig, renderTraffic]) {
        try { part(); } catch (err) { console.warn("aps dashboard: render failed", err); }
      }
    });
  }

  function renderHeader() {
    const s = app.server || {}, c = app.config, state = document.body.dataset.state;
    const last = app.points[app.points.length - 1] || {};
    const address = s.address || (c.host !== undefined && c.port !== undefined ? `tcp://${c.host}:${c.port}` : DASH);
    setText("address", address, address);
    setText("sync", fmtValue(s.sync || c.sync));
    setText("optimizer", fmtValue(s.optimizer || c.optimizer), fmtValue(s.optimizer || c.optimizer));

    let [pill, kind] = [state, state];
    if (state === "live" && s.started === false) [pill, kind] = ["waiting for workers", "waiting"];
    else if (state === "login") pill = "token needed";
    setText("status", pill);
    $("status").dataset.kind = kind;
    document.title = `aps · ${pill}`;

    setText("version", fmtInt(isNum(s.version) ? s.version : last.version));
    // The chart's newest point: the same window (rate_window_s) and the same moment as the chart.
    setText("rate", fmtFixed(isNum(last.updates_per_s) ? last.updates_per_s : s.updates_per_s, 1),
      `updates per second over the last ${app.rateWindowS} s, as the chart and aps status show them`);
    setText("rate-window", `last ${app.rateWindowS} s`);
    setText("chart-rate-window", `over the last ${app.rateWindowS} s`);
    setText("rate-mean", isNum(s.updates_per_s_mean) ? `mean ${s.updates_per_s_mean.toFixed(1)}` : "");
    const live = isNum(s.live) ? s.live : last.live, total = isNum(s.workers) ? s.workers : c.workers;
    setText("live", isNum(live) || isNum(total) ? `${fmtInt(live)} / ${fmtInt(total)}` : DASH);
    setText("uptime", fmtDuration(s.uptime_s));
    const runId = s.run_id || app.runId;
    setText("run-id", runId ? String(runId).slice(0, 8) : DASH, runId || "");
    setText("resumed", s.resumed_from ? "resumed" : "", s.resumed_from ? `resumed from ${s.resumed_from}` : "");
    const params = isNum(s.parameters) && s.parameters > 0 ? s.parameters : null;
    setText("parameters", fmtCount(params), params === null ? "" : params.toLocaleString("en-US"));

    const alarm = checkpointAlarm(s.checkpoints, Date.now() / 1000 + (app.clockOffset || 0));
    setText("checkpoint-alarm", alarm);
    $("checkpoint-alarm").hidden = !alarm || state !== "live";
    $("checkpoint").parentElement.dataset.alarm = alarm ? "failing" : "";

    const replicas = isObject(s.replicas) ? s.replicas : null, replicaAlarmText = replicaAlarm(replicas);
    $("replicas-box").hidden = !replicas;
    setText("replica-alarm", replicaAlarmText);
    $("replica-alarm").hidden = !replicaAlarmText || state !== "live";
    $("replicas-box").dataset.alarm = replicaAlarmText ? "alone" : "";
    if (replicas) {
      const listed = Array.isArray(replicas.listed) ? replicas.listed : [];
      const lag = isObject(replicas.lag) ? replicas.lag : {};
      setText("replicas", `${fmtInt(listed.length + 1)} · term ${fmtInt(replicas.term)}`,
        ["primary (this server)", ...listed.map((b) => `backup ${b} (lag ${fmtInt(lag[b] || 0)})`)].join("\n"));
      setText("replicas-detail", [replicas.took_over ? "took over" : "",
        Array.isArray(replicas.joining) && replicas.joining.length ? `${replicas.joining.length} catching up` : ""]
        .filter(Boolean).join(" · "));
    }

    const cp = s.checkpoint, counts = isObject(s.checkpoints) ? s.checkpoints : {};
    const failed = isNum(counts.failed) ? counts.failed : isObject(cp) ? cp.failed : 0;
    if (isObject(cp)) {
      const age = Date.now() / 1000 + (app.clockOffset || 0) - cp.written_unix;
      setText("checkpoint", isNum(age) ? `${fmtDuration(age)} ago` : DASH, cp.path ? String(cp.path) : "");
      setText("checkpoint-detail", [`v${fmtInt(cp.version)}`, cp.reason, failed ? `${failed} failed` : ""]
        .filter(Boolean).join(" · "));
    } else {
      setText("checkpoint", app.server ? "none" : DASH, "");
      setText("checkpoint-detail", failed ? `${failed} failed` : "");
    }
  }

  /**
   * The alarm for a replica set's primary with no backup listed, as `aps status` words it
   * ("" with a backup, or for a server without --replicas).
   */
  function replicaAlarm(status) {
    if (!isObject(status) || (Array.isArray(status.listed) && status.listed.length)) return "";
    const joining = Array.isArray(status.joining) ? status.joining : [];
    return "Running without backups: a crash of this primary loses what its last checkpoint does not hold"
      + (joining.length ? ` (catching up: ${joining.join(", ")}).` : ".");
  }

  /**
   * The alarm for a failing checkpoint, as `aps status` words it ("" while checkpoints are
   * written, or the server writes none): failures in a row, the newest error with the
   * version it was for and when, and how long since the last checkpoint written.
   */
  function checkpointAlarm(status, now) {
    if (!isObject(status) || status.failing !== true) return "";
    const error = isObject(status.last_error) ? status.last_error : {};
    const inARow = isNum(status.failed_in_a_row) ? status.failed_in_a_row : 1;
    const version = isNum(error.version) ? `version ${fmtInt(error.version)}` : "a checkpoint";
    const when = isNum(error.unix) ? `, ${fmtDuration(now - error.unix)} ago` : "";
    let text = `Checkpoints are failing: ${inARow} in a row. The newest, of ${version}${when}: `
      + `${typeof error.error === "string" && error.error ? error.error : "unknown error"}. `;
    if (isNum(status.last_written_unix)) {
      text += `The last checkpoint written is ${fmtDuration(now - status.last_written_unix)} old`
        + `${isNum(status.last_written_version) ? ` (version ${fmtInt(status.last_written_version)})` : ""}.`;
    } else if (isNum(status.since_unix)) {
      text += `None written in the ${fmtDuration(now - status.since_unix)} since the server started.`;
    } else text += "None written yet.";
    return text;
  }

  /** The table row of a rank, created on first use: <tr data-rank="R">. */
  function workerRow(rank) {
    let row = app.rows.get(rank);
    if (row) return row;
    row = el("tr");
    row.dataset.rank = String(rank);
    for (let i = 0; i < 17; i++) row.appendChild(el("td", "", i >= 2 ? "num" : ""));
    row.cells[1].appendChild(el("span"));
    $("workers").appendChild(row);
    app.rows.set(rank, row);
    return row;
  }

  function renderWorkers() {
    const workers = app.workers, slowest = slowestRank(workers), dssp = syncName() === "dssp";
    for (const w of workers) {
      const row = workerRow(w.rank), state = workerState(w), reported = isObject(w.reported) ? w.reported : null;
      row.className = `${state === "gone" ? "is-gone" : ""} ${w.rank === slowest ? "is-slowest" : ""}`.trim();
      row.cells[0].title = w.rank === slowest ? "slowest live worker" : "";
      const badge = row.cells[1].firstChild;
      badge.className = `state state-${state}`;
      badge.textContent = state;
      const values = [
        String(w.rank), null, fmtInt(w.clock), fmtInt(w.gap), fmtInt(w.pushes), fmtInt(w.pulls),
        fmtFixed(w.staleness_mean, 2), fmtInt(w.waits), fmtFixed(isNum(w.wait_s_mean) ? w.wait_s_mean * 1000 : null, 1),
        fmtFixed(w.wait_s_total, 2), dssp ? String(rStarGrants(w.r_star_hist)) : DASH, fmtInt(w.dropped),
        fmtInt(w.rejected), fmtLr(w),
        isNum(w.last_interval_s) && w.last_interval_s > 0 ? fmtFixed(1 / w.last_interval_s, 1) : DASH,
        reported && isNum(reported.cpu_percent) ? fmtFixed(reported.cpu_percent, 0) : DASH,
        reported && isObject(reported.process) ? fmtBytes(reported.process.rss_bytes) : DASH,
      ];
      row.cells[13].title = w.hyperparameters_own === true ? "set by the worker" : "";
      values.forEach((text, i) => {
        if (text !== null && row.cells[i].textContent !== text) row.cells[i].textContent = text;
      });
    }
    $("lr-note").hidden = !workers.some((w) => w.hyperparameters_own === true);
    const ranks = new Set(workers.map((w) => w.rank));
    for (const [rank, row] of app.rows) {
      if (!ranks.has(rank)) { row.remove(); app.rows.delete(rank); }
    }
    drawBars($("clocks"), workers.map((w) => clockBar(w, w.rank === slowest)), { axisLabel: "rank", empty: emptyText("no workers yet") });
  }

  /** What the workers log: a chart per scalar name (a line per rank), and the data warnings. */
  function renderTraining() {
    const names = [...app.curves.keys()].sort();
    $("training-card").hidden = !names.length && !app.dataWarnings.length;
    const warnings = $("data-warnings");
    warnings.hidden = !app.dataWarnings.length;
    const text = app.dataWarnings.map((w) => (isObject(w) ? String(w.message) : "")).join(" ");
    if (warnings.textContent !== text) warnings.textContent = text;
    setText("curves-count", names.length ? `${names.length} scalar${names.length > 1 ? "s" : ""}` : "");
    for (const name of names) {
      let entry = app.curveCards.get(name);
      if (!entry) {
        const card = el("div", "", "curve"), head = el("div", "", "curve-head");
        head.appendChild(el("h3", name));
        const ranks = el("span", "", "curve-ranks");
        head.appendChild(ranks);
        const canvas = el("canvas", "", "chart");
        canvas.dataset.scalar = name;
        canvas.setAttribute("aria-label", `${name} logged by each rank, against its step`);
        card.append(head, canvas);
        $("curves").appendChild(card);
        entry = { card, canvas, ranks };
        app.curveCards.set(name, entry);
        if (window.ResizeObserver) new ResizeObserver(() => scheduleRender()).observe(canvas);
      }
      const byRank = app.curves.get(name);
      const shown = [...byRank.entries()].sort((a, b) => a[0] - b[0]).slice(0, 6);
      const parts = shown.map(([rank, c]) => [rank, `${rank}: ${fmtG(c.values[c.values.length - 1])}`]);
      const more = byRank.size > 6 ? ` +${byRank.size - 6}` : "";
      const label = `rank ${parts.map(([, text]) => text).join(" · ")}${more}`;
      if (entry.ranks.textContent !== label) {  // each rank's newest value, in its line's color
        entry.ranks.textContent = "rank ";
        parts.forEach(([rank, text], i) => {
          if (i) entry.ranks.appendChild(document.createTextNode(" · "));
          const span = el("span", text);
          span.style.color = RANK_COLORS[rank % RANK_COLORS.length];
          entry.ranks.appendChild(span);
        });
        if (more) entry.ranks.appendChild(document.createTextNode(more));
      }
      drawCurveChart(entry.canvas, byRank);
    }
  }

  /** A bar of the clocks chart: colored by state, the gap to the slowest written above. */
  function clockBar(w, isSlowest) {
    const state = workerState(w);
    const bar = { label: String(w.rank), value: isNum(w.clock) ? w.clock : 0, color: COLORS[state],
      note: isNum(w.gap) ? `+${w.gap}` : "", noteColor: COLORS.text };
    if (state === "gone") Object.assign(bar, { dashed: true, note: "not live", noteColor: COLORS.muted });
    if (isSlowest) Object.assign(bar, { color: COLORS.slowest, note: "slowest", noteColor: COLORS.slowest, noteBold: true });
    return bar;
  }

  /**
   * The model's embedding tables, one row each (<tr data-table="NAME">): rows and bytes held,
   * rows pulled and pushed per second (over the window of every rate shown, the server's
   * frames say) and since the server process started, rows evicted; the bytes the rows take
   * against the server's limit (--table-memory, or half the memory available at its start).
   * No tables: no card.
   */
  function renderTables() {
    const tables = app.server && isObject(app.server.tables) ? app.server.tables : {};
    const names = Object.keys(tables).filter((name) => isObject(tables[name]));
    $("tables-card").hidden = !names.length;
    setText("tables-window", `rows/s over the last ${app.rateWindowS} s`);
    let held = 0;
    for (const name of names) {
      const t = tables[name];
      let row = app.tableRows.get(name);
      if (!row) {
        row = el("tr");
        row.dataset.table = name;
        for (let i = 0; i < 10; i++) row.appendChild(el("td", "", i === 0 || i === 2 ? "" : "num"));
        app.tableRows.set(name, row);
        $("tables").appendChild(row);  // (in the server's order: the tables' declared order)
      }
      if (isNum(t.bytes)) held += t.bytes;
      const values = [
        name, fmtInt(t.dim), fmtValue(t.optimizer), fmtInt(t.rows), fmtBytes(t.bytes),
        fmtFixed(t.rows_pulled_per_s, 1), fmtFixed(t.rows_pushed_per_s, 1), fmtInt(t.rows_pulled),
        fmtInt(t.rows_pushed), fmtInt(t.rows_evicted),
      ];
      values.forEach((text, i) => {
        if (row.cells[i].textContent !== text) row.cells[i].textContent = text;
      });
    }
    for (const [name, row] of app.tableRows) {
      if (!Object.prototype.hasOwnProperty.call(tables, name)) { row.remove(); app.tableRows.delete(name); }
    }
    const memory = app.server && isObject(app.server.table_memory) ? app.server.table_memory : null;
    let total = names.length ? `${fmtBytes(held)} held` : "", title = "";
    if (names.length && memory && isNum(memory.bytes)) {
      total = isNum(memory.limit) ? `${fmtBytes(memory.bytes)} of ${fmtBytes(memory.limit)} held`
        : `${fmtBytes(memory.bytes)} held, no limit`;
      title = !isNum(memory.limit) ? "--table-memory 0: the rows may take any memory"
        : memory.default ? "the limit: half the memory available when the server started (--table-memory sets it)"
          : "the limit: --table-memory";
    }
    setText("tables-total", total, title);
  }

  function renderHistory() {
    const last = app.points[app.points.length - 1] || {};
    document.body.dataset.points = String(app.points.length);
    setText("rate-now", isNum(last.updates_per_s) ? `${last.updates_per_s.toFixed(1)} /s` : "");
    setText("staleness-now", isNum(last.staleness_mean) ? last.staleness_mean.toFixed(2) : "");
    setText("wait-now", isNum(last.gate_wait_ms) ? `${last.gate_wait_ms.toFixed(1)} ms` : "");
    drawLineChart($("chart-rate"), "updates_per_s", COLORS.accent);
    drawLineChart($("chart-staleness"), "staleness_mean", COLORS.slowest);
    drawLineChart($("chart-wait"), "gate_wait_ms", COLORS.held);
  }

  function renderRStar() {
    const sync = syncName(), shown = sync === null || sync === "dssp";
    $("chart-rstar").hidden = !shown;
    $("rstar-note").hidden = shown;
    const totals = new Map();
    for (const w of app.workers) {
      for (const [key, n] of histEntries(w.r_star_hist)) {
        if (Number.isInteger(Number(key))) totals.set(Number(key), (totals.get(Number(key)) || 0) + n);
      }
    }
    const sum = [...totals.values()].reduce((a, b) => a + b, 0);
    setText("rstar-total", shown && sync ? `${sum} grant${sum === 1 ? "" : "s"}` : "");
    if (!shown) return;
    let values = [...totals.keys()].sort((a, b) => a - b);
    const low = Math.min(0, values[0]), high = values[values.length - 1];
    if (values.length && high - low <= 40) values = Array.from({ length: high - low + 1 }, (_, i) => low + i);
    const bars = values.map((r) => ({ label: String(r), value: totals.get(r) || 0, color: COLORS.accent,
      note: totals.get(r) ? String(totals.get(r)) : "" }));
    drawBars($("chart-rstar"), bars, { axisLabel: "r*", empty: emptyText(sync ? "no grants yet" : "no data yet") });
  }

  function renderEvents() {
    if (!app.dirty.events) return;
    app.dirty.events = false;
    const items = app.events.map((e) => {
      const name = typeof e.event === "string" ? e.event : DASH;
      const li = el("li");
      li.append(el("span", isNum(e.t) ? fmtClockTime(e.t) : DASH, "time"), el("span", fmtInt(e.rank)),
        el("span", name, `ev-${name.replace(/\s+/g, "-")}`), el("span", fmtInt(e.clock), "num"),
        el("span", fmtInt(e.live), "num"));
      return li;
    });
    $("events").replaceChildren(...(items.length ? items : [el("li", emptyText("no membership events yet"), "empty")]));
    setText("events-count", app.events.length ? `${app.events.length} shown, newest first` : "");
  }

  function renderConfig() {
    if (!app.dirty.config) return;
    app.dirty.config = false;
    $("config").replaceChildren(...Object.entries(app.config).map(([key, value]) => {
      const row = el("tr");
      row.append(el("td", key), el("td", fmtValue(value)));
      return row;
    }));
    setText("aps-version", app.apsVersion ? `aps ${app.apsVersion}` : "");
  }

  function renderTraffic() {
    const s = app.server;
    if (!s) {
      $("traffic").replaceChildren(el("tr", undefined, "empty"));
      $("traffic").firstChild.append(el("td", emptyText("no traffic yet")));
      return;
    }
    const transports = isObject(s.transports) ? s.transports : {};
    const names = ["tcp", "shm", ...Object.keys(transports).filter((n) => n !== "tcp" && n !== "shm")];
    const rows = names.map((name) => [name, isObject(transports[name]) ? transports[name] : {}]);
    rows.push(["total", s]);
    $("traffic").replaceChildren(...rows.map(([name, t]) => {
      const row = el("tr", undefined, name === "total" ? "total" : "");
      row.append(el("td", name), el("td", fmtBytes(t.bytes_in), "num"), el("td", fmtBytes(t.bytes_out), "num"));
      return row;
    }));
    const p = isObject(s.process) ? s.process : {};
    const cpu = isNum(p.cpu_s) && p.cpu_s < 60 ? `${p.cpu_s.toFixed(1)} s` : fmtDuration(p.cpu_s);
    const facts = [
      ["memory (RSS)", fmtBytes(p.rss_bytes)], ["CPU time", cpu], ["threads", fmtInt(p.threads)], ["pid", fmtInt(p.pid)],
      ["pushes", fmtInt(s.pushes)], ["dropped / rejected", `${fmtInt(s.dropped)} / ${fmtInt(s.rejected)}`],
      ["duplicates", fmtInt(s.duplicates)],
    ];
    $("process").replaceChildren(...facts.flatMap(([key, value]) => [el("dt", key), el("dd", value)]));
  }

  /* ---------- canvas charts ---------- */

  /** Size the canvas backing store to its CSS box times devicePixelRatio; a context in CSS pixels. */
  function prepareCanvas(canvas) {
    const w = canvas.clientWidth, h = canvas.clientHeight;
    if (!w || !h) return null;
    const dpr = window.devicePixelRatio || 1;
    const width = Math.round(w * dpr), height = Math.round(h * dpr);
    if (canvas.width !== width || canvas.height !== height) { canvas.width = width; canvas.height = height; }
    const ctx = canvas.getContext("2d");
    delete canvas.dataset.empty;
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    ctx.font = `11px ${FONT}`;
    ctx.textBaseline = "middle";
    return { ctx, w, h, canvas };
  }

  function drawEmpty({ ctx, w, h, canvas }, text) {
    canvas.dataset.empty = text;  // what it says, for readers of the page's text (and its tests)
    ctx.fillStyle = COLORS.muted;
    ctx.textAlign = "center";
    ctx.fillText(text, w / 2, h / 2);
  }

  /** Round ticks from 0 to at least max: {ticks, top, step}. */
  function niceTicks(max, count, integer) {
    if (!(max > 0)) max = integer ? count : 1;
    const raw = max / count, mag = 10 ** Math.floor(Math.log10(raw)), f = raw / mag;
    let step = (f <= 1 ? 1 : f <= 2 ? 2 : f <= 2.5 && !integer ? 2.5 : f <= 5 ? 5 : 10) * mag;
    if (integer) step = Math.max(1, Math.round(step));
    const n = Math.max(1, Math.ceil(max / step - 1e-9));
    return { ticks: Array.from({ length: n + 1 }, (_, i) => i * step), top: n * step, step };
  }

  function fmtTick(v, step) {
    if (v >= 10000) return `${+(v / 1000).toFixed(step >= 1000 ? 0 : 1)}k`;
    let digits = 0;
    while (digits < 6 && Math.abs(step * 10 ** digits - Math.round(step * 10 ** digits)) > 1e-6) digits++;
    return v.toFixed(digits);
  }

  /** Horizontal grid lines and y labels (of base + each tick: scale.base, 0 by default); returns the plot box. */
  function drawYAxis(ctx, w, h, scale, pad) {
    const labels = scale.ticks.map((v) => fmtTick((scale.base || 0) + v, scale.step));
    const left = Math.ceil(Math.max(...[...labels, pad.xLabel || ""].map((s) => ctx.measureText(s).width))) + 10;
    const box = { x: left, y: pad.top, w: w - left - pad.right, h: h - pad.top - pad.bottom };
    ctx.textAlign = "right";
    ctx.lineWidth = 1;
    scale.ticks.forEach((v, i) => {
      const y = Math.round(box.y + box.h - (v / scale.top) * box.h) + 0.5;
      ctx.strokeStyle = i === 0 ? COLORS.line : COLORS.grid;
      ctx.beginPath();
      ctx.moveTo(box.x, y);
      ctx.lineTo(box.x + box.w, y);
      ctx.stroke();
      ctx.fillStyle = COLORS.muted;
      ctx.fillText(labels[i], box.x - 6, y);
    });
    return box;
  }

  /** A bar chart; bars: [{label, value, color, note, noteColor, noteBold, dashed}]. */
  function drawBars(canvas, bars, options) {
    const c = prepareCanvas(canvas);
    if (!c) return;
    if (!bars.length) { drawEmpty(c, options.empty); return; }
    const ctx = c.ctx;
    const scale = niceTicks(Math.max(...bars.map((b) => b.value)), 4, true);
    const box = drawYAxis(ctx, c.w, c.h, scale, { top: 18, right: 6, bottom: 20, xLabel: options.axisLabel });
    const slot = box.w / bars.length, barW = Math.max(1, Math.min(56, slot * 0.68));
    const labelEvery = Math.max(1, Math.ceil(24 / slot));
    ctx.textAlign = "center";
    bars.forEach((bar, i) => {
      const cx = box.x + slot * (i + 0.5);
      const bh = Math.max(bar.value > 0 ? 1 : 0, (bar.value / scale.top) * box.h);
      const x = cx - barW / 2, y = box.y + box.h - bh;
      ctx.fillStyle = bar.color;
      ctx.fillRect(x, y, barW, bh);
      if (bar.dashed) {
        ctx.setLineDash([3, 2]);
        ctx.strokeStyle = COLORS.muted;
        ctx.strokeRect(x + 0.5, y + 0.5, barW - 1, Math.max(0, bh - 1));
        ctx.setLineDash([]);
      }
      if (bar.note && ctx.measureText(bar.note).width <= slot + 2) {
        ctx.font = `${bar.noteBold ? "600 " : ""}11px ${FONT}`;
        ctx.fillStyle = bar.noteColor || COLORS.text;
        ctx.fillText(bar.note, cx, y - 8);
        ctx.font = `11px ${FONT}`;
      }
      ctx.fillStyle = COLORS.muted;
      if (i % labelEvery === 0) ctx.fillText(bar.label, cx, box.y + box.h + 11);
    });
    ctx.textAlign = "right";
    ctx.fillText(options.axisLabel, box.x - 6, box.y + box.h + 11);
  }

  /** Time window and ticks of the history charts, ending at the newest point. */
  function timeAxis(points) {
    const end = points[points.length - 1].t, have = end - points[0].t;
    const span = [60, 120, 180, 300, 600].find((s) => s >= have) || WINDOW_S;
    const step = { 60: 10, 120: 20, 180: 30, 300: 60, 600: 120 }[span];
    const ticks = [];
    for (let ago = 0; ago <= span; ago += step) {
      ticks.push({ ago, label: ago === 0 ? "now" : span <= 180 ? `−${ago} s` : `−${ago / 60} min` });
    }
    return { start: end - span, end, span, ticks };
  }

  /** A line chart of one point field over time; nulls and silences leave gaps. */
  function drawLineChart(canvas, key, lineColor) {
    const c = prepareCanvas(canvas);
    if (!c) return;
    const points = app.points;
    if (!points.length) { drawEmpty(c, emptyText("no history yet")); return; }
    const ctx = c.ctx, axis = timeAxis(points);
    const values = points.map((p) => (isNum(p[key]) ? p[key] : null));
    const scale = niceTicks(Math.max(0, ...values.filter((v) => v !== null)), 4, false);
    const box = drawYAxis(ctx, c.w, c.h, scale, { top: 8, right: 12, bottom: 20 });
    const xOf = (t) => box.x + ((t - axis.start) / axis.span) * box.w;
    const yOf = (v) => box.y + box.h - (v / scale.top) * box.h;

    ctx.fillStyle = COLORS.muted;
    const widest = Math.max(...axis.ticks.map((tick) => ctx.measureText(tick.label).width));
    const every = Math.ceil((widest + 12) / (box.w / (axis.ticks.length - 1)));
    axis.ticks.forEach(({ ago, label }, i) => {
      if (i % every) return;
      ctx.textAlign = i === 0 ? "right" : ago === axis.span ? "left" : "center";
      ctx.fillText(label, xOf(axis.end - ago), box.y + box.h + 11);
    });

    const maxGap = Math.max(3, 3 * app.everyS);
    const runs = [];
    let run = [];
    points.forEach((p, i) => {
      if (values[i] === null || (i > 0 && p.t - points[i - 1].t > maxGap)) { if (run.length) runs.push(run); run = []; }
      if (values[i] !== null) run.push([xOf(p.t), yOf(values[i])]);
    });
    if (run.length) runs.push(run);

    const trace = (r) => { ctx.beginPath(); r.forEach(([x, y], i) => (i ? ctx.lineTo(x, y) : ctx.moveTo(x, y))); };
    ctx.lineJoin = "round";
    ctx.fillStyle = ctx.strokeStyle = lineColor;
    for (const r of runs) {
      trace(r);
      ctx.lineTo(r[r.length - 1][0], box.y + box.h);
      ctx.lineTo(r[0][0], box.y + box.h);
      ctx.globalAlpha = 0.1;
      ctx.fill();
      ctx.globalAlpha = 1;
      trace(r);
      if (r.length === 1) ctx.arc(r[0][0], r[0][1], 1.5, 0, 2 * Math.PI);
      ctx.lineWidth = 1.6;
      ctx.stroke();
    }
    if (runs.length && values[values.length - 1] !== null) {
      const [x, y] = runs[runs.length - 1][runs[runs.length - 1].length - 1];
      ctx.beginPath();
      ctx.arc(x, y, 3, 0, 2 * Math.PI);
      ctx.fill();
    }
  }

  /** One scalar against the step, a line per rank (colored by rank); nulls leave gaps. */
  function drawCurveChart(canvas, byRank) {
    const c = prepareCanvas(canvas);
    if (!c) return;
    const curves = [...byRank.entries()].sort((a, b) => a[0] - b[0]);
    let lo = Infinity, hi = -Infinity, first = Infinity, last = -Infinity;
    for (const [, curve] of curves) {
      curve.values.forEach((v, i) => {
        if (v === null) return;
        lo = Math.min(lo, v); hi = Math.max(hi, v);
        first = Math.min(first, curve.steps[i]); last = Math.max(last, curve.steps[i]);
      });
    }
    if (!(hi >= lo)) { drawEmpty(c, "no values yet"); return; }
    const ctx = c.ctx;
    const floor = lo >= 0 && lo < 0.25 * hi ? 0 : lo;  // (a loss going down to 0 reads best from 0)
    let scale = niceTicks(hi - floor || Math.abs(hi) || 1, 4, false);
    const base = Math.floor(floor / scale.step) * scale.step;
    if (base + scale.top < hi) scale = { ...scale, top: scale.top + scale.step, ticks: [...scale.ticks, scale.top + scale.step] };
    const box = drawYAxis(ctx, c.w, c.h, { ...scale, base }, { top: 8, right: 12, bottom: 20 });
    const width = Math.max(1, last - first);
    const xOf = (step) => box.x + ((step - first) / width) * box.w;
    const yOf = (v) => box.y + box.h - ((v - base) / scale.top) * box.h;
    ctx.fillStyle = COLORS.muted;
    ctx.textAlign = "left";
    ctx.fillText(`step ${fmtInt(first)}`, box.x, box.y + box.h + 11);
    ctx.textAlign = "right";
    ctx.fillText(fmtInt(last), box.x + box.w, box.y + box.h + 11);
    ctx.lineJoin = "round";
    ctx.lineWidth = 1.4;
    for (const [rank, curve] of curves) {
      ctx.strokeStyle = ctx.fillStyle = RANK_COLORS[rank % RANK_COLORS.length];
      ctx.beginPath();
      let drawing = false;
      curve.values.forEach((v, i) => {
        if (v === null) { drawing = false; return; }
        const x = xOf(curve.steps[i]), y = yOf(v);
        if (drawing) ctx.lineTo(x, y); else ctx.moveTo(x, y);
        drawing = true;
      });
      ctx.stroke();
      if (curve.values.length === 1 && curve.values[0] !== null) {
        ctx.beginPath();
        ctx.arc(xOf(curve.steps[0]), yOf(curve.values[0]), 2, 0, 2 * Math.PI);
        ctx.fill();
      }
    }
  }

  /* ---------- start ---------- */

  $("login").addEventListener("submit", submitLogin);
  window.addEventListener("hashchange", () => {
    if (!/(?:^#|[&;])token=/.test(location.hash)) return;
    app.token = takeToken();
    $("login").hidden = true;
    setState("connecting");
    connect();
  });
  window.addEventListener("resize", scheduleRender);
  if (window.ResizeObserver) {
    const observer = new ResizeObserver(() => scheduleRender());
    document.querySelectorAll("canvas").forEach((canvas) => observer.observe(canvas));
  }
  // The checkpoint's age moves on between messages.
  setInterval(() => { if (document.body.dataset.state === "live") scheduleRender(); }, 1000);
  setState("connecting");
  connect();
})();
