// prefixcache dashboard: what both pages share (the key, polling, formatting, SVG charts).
// No library and no markup built from data: text goes in with textContent only.
"use strict";

const PC = (() => {
  const KEY = "prefixcache.dashboard.key";
  const SVG = "http://www.w3.org/2000/svg";

  // A key given as /dashboard#key=... moves into sessionStorage and leaves the address bar.
  function takeKeyFromFragment() {
    const m = /^#key=(.+)$/.exec(window.location.hash);
    if (m) {
      sessionStorage.setItem(KEY, decodeURIComponent(m[1]));
      history.replaceState(null, "", window.location.pathname);
    }
  }

  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  function setText(id, text, value) {
    const node = document.getElementById(id);
    if (!node) return;
    node.textContent = text;
    if (value !== undefined) node.dataset.value = String(value);
  }

  function num(n) {
    if (n === null || n === undefined) return "–";
    const a = Math.abs(n);
    if (a >= 1e9) return (n / 1e9).toFixed(2) + "G";
    if (a >= 1e6) return (n / 1e6).toFixed(2) + "M";
    if (a >= 1e4) return (n / 1e3).toFixed(1) + "k";
    return String(Math.round(n * 100) / 100);
  }

  function pct(r) {
    return r === null || r === undefined ? "–" : (100 * r).toFixed(1) + "%";
  }

  function secs(s) {
    if (s === null || s === undefined) return "–";
    if (s === 0) return "0";
    const ms = 1000 * s;
    if (s < 1) return (Number.isInteger(Math.round(ms * 10) / 10) ? ms.toFixed(0) : ms.toFixed(1)) + " ms";
    return (Number.isInteger(Math.round(s * 100) / 100) ? s.toFixed(0) : s.toFixed(2)) + " s";
  }

  function bytes(n) {
    if (!n) return "0 B";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
    return n.toFixed(i ? 1 : 0) + " " + units[i];
  }

  // Replace a table body's rows (cells: [text, className] pairs or plain text).
  function fillTable(tbodyId, rows, emptyText, columns) {
    const body = document.getElementById(tbodyId);
    body.replaceChildren();
    if (!rows.length) {
      const td = el("td", { colspan: String(columns), class: "empty" }, emptyText);
      body.append(el("tr", { class: "empty-row" }));
      body.lastChild.append(td);
      return;
    }
    for (const cells of rows) {
      const tr = el("tr");
      for (const c of cells) {
        const [text, cls] = Array.isArray(c) ? c : [c, ""];
        tr.append(el("td", cls ? { class: cls } : {}, text));
      }
      body.append(tr);
    }
  }

  // A "nice" top and step for 4 grid intervals: step 1, 2, 2.5 or 5 times a power of ten, so
  // tick labels are round (0, 50, 100, 150, 200 rather than 0, 52.5, 105, ...).
  function niceScale(top) {
    if (!(top > 0)) return { top: 1, step: 0.25 };
    const raw = top / 4;
    const p = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 2.5, 5, 10].map((m) => m * p).find((s) => s >= raw * (1 - 1e-9));
    return { top: step * 4, step };
  }

  // How long ago `age` seconds was, for a time axis: "now", "-30 s", "-2.5 min", "-12 min".
  function ago(age) {
    if (age < 0.5) return "now";
    if (age < 120) return "-" + Math.round(age) + " s";
    const m = age / 60;
    return "-" + (m < 10 ? Math.round(m * 2) / 2 : Math.round(m)) + " min";
  }

  // A line chart in an <svg class="chart">: series = [{values: [number|null]}], one per line,
  // drawn in classes s0.. (their colours come from the stylesheet, so both themes apply).
  // opts: max (a fixed top), format (tick labels), times (each point's time, seconds) and now:
  // then points sit at their time and the x axis says how long ago.
  function lineChart(svgId, series, opts) {
    const svg = document.getElementById(svgId);
    if (!svg) return;
    opts = opts || {};
    // One user unit per CSS pixel (the drawn width), so text and strokes are not stretched.
    const W = Math.max(200, Math.round(svg.getBoundingClientRect().width) || 600);
    const H = 180, L = 52, R = 12, T = 8, B = opts.times ? 22 : 8;
    svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
    svg.replaceChildren();
    const n = Math.max(0, ...series.map((s) => s.values.length));
    const all = series.flatMap((s) => s.values.filter((v) => v !== null && v !== undefined));
    const scale = opts.max !== undefined ? { top: opts.max, step: opts.max / 4 } : niceScale(Math.max(0, ...all));
    const top = scale.top;
    const fmt = opts.format || num;
    const text = (x, y, anchor, content) => {
      const label = document.createElementNS(SVG, "text");
      label.setAttribute("x", String(x));
      label.setAttribute("y", String(y));
      label.setAttribute("text-anchor", anchor);
      label.setAttribute("class", "axis");
      label.textContent = content;
      svg.append(label);
    };
    for (let i = 0; i <= 4; i++) {
      const y = T + ((H - T - B) * i) / 4;
      const line = document.createElementNS(SVG, "line");
      for (const [k, v] of [["x1", L], ["x2", W - R], ["y1", y], ["y2", y], ["class", "grid"]]) line.setAttribute(k, v);
      svg.append(line);
      text(L - 4, y + 3, "end", fmt(Math.round((top - scale.step * i) * 1e6) / 1e6));
    }
    if (n === 0) {
      text(W / 2, H / 2, "middle", "no data yet");
      return;
    }
    const times = opts.times && opts.times.length === n ? opts.times : null;
    const t0 = times ? times[0] : 0;
    const t1 = times ? Math.max(opts.now || times[n - 1], times[n - 1]) : 0;
    const span = times ? Math.max(t1 - t0, 1e-9) : 0;
    const x = (i) => times
      ? L + ((W - L - R) * (times[i] - t0)) / span
      : L + ((W - L - R) * (n === 1 ? 1 : i / (n - 1)));
    if (times) {
      // Ticks at round ages back from the right edge ("now"), 4 to 6 of them.
      const steps = [2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600];
      const step = steps.find((s) => span / s <= 5) || steps[steps.length - 1];
      for (let age = 0; age <= span + 1e-6; age += step) {
        const px = L + ((W - L - R) * (span - age)) / span;
        const tick = document.createElementNS(SVG, "line");
        for (const [k, v] of [["x1", px], ["x2", px], ["y1", H - B], ["y2", H - B + 4], ["class", "grid"]]) tick.setAttribute(k, v);
        svg.append(tick);
        text(px, H - 6, age === 0 ? "end" : "middle", ago(age + (opts.now ? opts.now - t1 : 0)));
      }
    }
    const y = (v) => T + (H - T - B) * (1 - Math.min(v, top) / top);
    series.forEach((s, k) => {
      let d = "";
      let pen = false;
      s.values.forEach((v, i) => {
        if (v === null || v === undefined) { pen = false; return; }
        d += (pen ? "L" : "M") + x(i).toFixed(1) + " " + y(v).toFixed(1) + " ";
        pen = true;
        if (i === s.values.length - 1 || s.values[i + 1] === null || s.values[i - 1] === null) {
          const dot = document.createElementNS(SVG, "circle");
          dot.setAttribute("cx", x(i).toFixed(1));
          dot.setAttribute("cy", y(v).toFixed(1));
          dot.setAttribute("r", "2.5");
          dot.setAttribute("class", "dot" + k);
          svg.append(dot);
        }
      });
      if (d) {
        const path = document.createElementNS(SVG, "path");
        path.setAttribute("d", d);
        path.setAttribute("class", "line s" + k);
        svg.append(path);
      }
    });
  }

  // Horizontal bars: rows = [[label, value]] (values >= 0).
  function bars(containerId, rows, fmt) {
    const box = document.getElementById(containerId);
    box.replaceChildren();
    if (!rows.length) {
      box.append(el("div", { class: "empty" }, "no data yet"));
      return;
    }
    const top = Math.max(1, ...rows.map((r) => r[1]));
    for (const [label, value] of rows) {
      const row = el("div", { class: "row" });
      const track = el("div", { class: "track" });
      const svg = document.createElementNS(SVG, "svg");
      svg.setAttribute("viewBox", "0 0 100 10");
      svg.setAttribute("preserveAspectRatio", "none");
      const rect = document.createElementNS(SVG, "rect");
      rect.setAttribute("x", "0");
      rect.setAttribute("y", "0");
      rect.setAttribute("height", "10");
      rect.setAttribute("width", String((100 * value) / top));
      svg.append(rect);
      track.append(svg);
      row.append(el("span", {}, label), track, el("span", { class: "num" }, (fmt || num)(value)));
      box.append(row);
    }
  }

  // Poll `url` every `everyMs` with the stored key; `render(data)` on success. A 401 shows the
  // key form; any other failure is shown in #status and retried.
  function poll(url, everyMs, render) {
    takeKeyFromFragment();
    const form = document.getElementById("key-form");
    const input = document.getElementById("key-input");
    const status = document.getElementById("status");
    let timer = null;

    async function tick() {
      clearTimeout(timer);
      const key = sessionStorage.getItem(KEY);
      const headers = { accept: "application/json" };
      if (key) headers.authorization = "Bearer " + key;
      try {
        const r = await fetch(url, { headers, cache: "no-store", credentials: "omit" });
        if (r.status === 401) {
          form.hidden = false;
          status.className = "error";
          status.textContent = key ? "the key was refused" : "an API key is needed";
        } else if (!r.ok) {
          let message = "HTTP " + r.status;
          try { message = (await r.json()).error.message || message; } catch (e) { /* not JSON */ }
          status.className = "error";
          status.textContent = message;
        } else {
          const data = await r.json();
          form.hidden = true;
          render(data);
          status.className = "ok";
          status.textContent = "updated " + new Date().toLocaleTimeString();
          document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
        }
      } catch (e) {
        status.className = "error";
        status.textContent = "unreachable: " + e.message;
      }
      timer = setTimeout(tick, everyMs);
    }

    form.addEventListener("submit", (ev) => {
      ev.preventDefault();
      sessionStorage.setItem(KEY, input.value.trim());
      input.value = "";
      tick();
    });
    document.getElementById("forget-key").addEventListener("click", () => {
      sessionStorage.removeItem(KEY);
      tick();
    });
    tick();
  }

  return { el, setText, num, pct, secs, bytes, fillTable, lineChart, niceScale, ago, bars, poll };
})();
