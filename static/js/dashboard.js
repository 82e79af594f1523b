/* Dashboard charts (plotly from static/vendor). Data comes embedded as JSON for the first paint; on the
 * endpoint page the time series are then refreshed from the REST timeseries API every REFRESH_MS, so points
 * appear while traffic flows. Each chart element keeps Plotly's `.data`, which tests read. */
(function () {
  "use strict";
  var REFRESH_MS = 5000;
  var RETRY_MS = 15000;
  var CONFIG = { displaylogo: false, responsive: true };
  var COLORS = { shadow: "#b54708", prod: "#067647", speculative: "#2457c5", baseline: "#98a2b3" };

  function json(id) {
    var el = document.getElementById(id);
    return el ? JSON.parse(el.textContent) : null;
  }

  function layout(title, ytitle, extra) {
    var base = { title: { text: title, font: { size: 14 } }, margin: { l: 50, r: 10, t: 40, b: 40 },
      yaxis: { title: { text: ytitle }, rangemode: "tozero" }, legend: { orientation: "h", y: -0.2 }, height: 300 };
    return Object.assign(base, extra || {});
  }

  function lines(ts) {
    return ts.series.map(function (s) {
      return { x: s.t, y: s.y, name: s.name, type: "scatter", mode: "lines+markers",
        line: { color: COLORS[s.name] }, customdata: s.n, hovertemplate: "%{y} (%{customdata} records)<extra>" + s.name + "</extra>" };
    });
  }

  // Policy changes: one trace of small markers along the top (the change on hover), and a light band per mode
  // span while there are at most MAX_MODE_BANDS of them; more switching than that is left to the markers, so
  // 100 switches in an hour draw 100 markers and no shape over the data.
  var MAX_MODE_BANDS = 12;
  var CHANGE_COLOR = "#6b7585";

  function changeMarkers(points) {
    return { x: points.map(function (p) { return p.at; }), y: points.map(function () { return 1; }),
      yaxis: "y2", name: "policy changes", type: "scatter", mode: "markers", showlegend: false, cliponaxis: false,
      marker: { symbol: "triangle-down", size: 7, color: CHANGE_COLOR, opacity: 0.7 },
      hovertext: points.map(function (p) { return (p.by ? p.by + ": " : "") + p.summary; }), hoverinfo: "x+text" };
  }

  function modeBands(ts) {
    var spans = [], start = ts.since, mode = null;
    (ts.change_points || []).forEach(function (p) {
      var change = p.changes && p.changes.mode;
      if (!change) return;
      spans.push({ x0: start, x1: p.at, mode: change[0] });
      start = p.at; mode = change[1];
    });
    if (mode !== null) spans.push({ x0: start, x1: ts.until, mode: mode });
    if (spans.length > MAX_MODE_BANDS) return [];
    return spans.filter(function (s) { return COLORS[s.mode] && Date.parse(s.x0) < Date.parse(s.x1); }).map(function (s) {
      return { type: "rect", xref: "x", yref: "paper", x0: s.x0, x1: s.x1, y0: 0, y1: 1, layer: "below",
        fillcolor: COLORS[s.mode], opacity: 0.07, line: { width: 0 } };
    });
  }

  function drawSeries(id, ts, ytitle, withMarks) {
    var el = document.getElementById(id);
    if (!el || !ts) return;
    var traces = lines(ts), extra = { xaxis: { type: "date", range: [ts.since, ts.until] } };
    var points = withMarks ? ts.change_points || [] : [];
    if (points.length) {
      traces.push(changeMarkers(points));
      extra.yaxis2 = { overlaying: "y", range: [0, 1.04], visible: false, fixedrange: true };
      extra.shapes = modeBands(ts);
    }
    Plotly.react(el, traces, layout(ts.label, ytitle, extra), CONFIG);
  }

  function drawBars(id, perMode, title, xtitle, xs) {
    var el = document.getElementById(id);
    if (!el || !perMode) return;
    var traces = Object.keys(perMode).map(function (mode) {
      var ys = perMode[mode];
      return { x: xs(ys), y: ys, name: mode, type: "bar", marker: { color: COLORS[mode] } };
    });
    Plotly.react(el, traces, layout(title, "", { barmode: "group", xaxis: { title: { text: xtitle }, dtick: 1 } }), CONFIG);
  }

  function drawEndpoint(data) {
    drawSeries("chart-acceptance", data.acceptance_rate, "accepted / drafted", true);
    drawSeries("chart-multiplier", data.multiplier, "× plain tok/s", true);
    drawSeries("chart-toks", data.tok_s, "tok/s", false);
    if (data.per_position) {
      drawBars("chart-positions", data.per_position, "Acceptance by draft position", "position",
        function (ys) { return ys.map(function (_, i) { return i + 1; }); });
    }
    if (data.histogram) {
      drawBars("chart-histogram", data.histogram, "Accepted draft tokens per verification step", "accepted",
        function (ys) { return ys.map(function (_, i) { return i; }); });
    }
  }

  function refresh(box, data) {
    var url = box.dataset.timeseriesUrl, range = box.dataset.range;
    var workload = box.dataset.workload ? "&workload=" + encodeURIComponent(box.dataset.workload) : "";
    var metrics = ["acceptance_rate", "multiplier", "tok_s"];
    Promise.all(metrics.map(function (m) {
      return fetch(url + "?metric=" + m + "&range=" + range + workload, { credentials: "same-origin", headers: { Accept: "application/json" } })
        .then(function (r) { if (!r.ok) throw new Error("HTTP " + r.status); return r.json(); });
    })).then(function (results) {
      metrics.forEach(function (m, i) { data[m] = results[i]; });
      drawEndpoint(data);
      var empty = document.getElementById("charts-empty");
      if (empty && results[0].series.length) empty.hidden = true;
      setTimeout(function () { refresh(box, data); }, REFRESH_MS);
    }).catch(function (err) {
      // a hiccup (server restart, a busy database) must not freeze the charts: retry, more slowly;
      // a lost session (401/403) stops the polling
      if (window.console) console.warn("chart refresh failed:", err);
      if (!/HTTP 40[13]/.test(String(err))) setTimeout(function () { refresh(box, data); }, RETRY_MS);
    });
  }

  var endpointData = json("chart-data");
  if (endpointData) {
    drawEndpoint(endpointData);
    var box = document.getElementById("charts");
    if (box && box.dataset.timeseriesUrl) setTimeout(function () { refresh(box, endpointData); }, REFRESH_MS);
  }

  var bars = json("bars-data");
  if (bars) {
    Plotly.react("chart-bars", [
      { x: bars.names, y: bars.baseline, name: "baseline tok/s", type: "bar", marker: { color: COLORS.baseline } },
      { x: bars.names, y: bars.speculative, name: "speculative tok/s", type: "bar", marker: { color: COLORS.speculative },
        text: bars.multiplier.map(function (m) { return m == null ? "" : m.toFixed(2) + "×"; }), textposition: "outside" }
    ], layout("", "tok/s", { barmode: "group" }), CONFIG);
  }

  var proj = json("projection-data");
  if (proj) {
    Plotly.react("chart-projection", [{ x: proj.k, y: proj.s, type: "scatter", mode: "lines+markers", name: "S(K)" }],
      layout("", "× plain tok/s", { xaxis: { title: { text: "K" }, dtick: 1 } }), CONFIG);
  }
})();
