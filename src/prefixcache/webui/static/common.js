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
    return s < 1 ? (1000 * s).toFixed(1) + " ms" : s.toFixed(2) + " s";
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

  // A line chart in an <svg class="chart">: series = [{values: [number|null]}], one per line,
  // drawn in classes s0.. (their colours come from the stylesheet, so both themes apply).
  function lineChart(svgId, series, opts) {
    const svg = document.getElementById(svgId);
    if (!svg) return;
    // One user unit per CSS pixel (the drawn width), so text and strokes are not stretched.
    const W = Math.max(200, Math.round(svg.getBoundingClientRect().width) || 600);
    const H = 180, L = 52, R = 8, T = 8, B = 8;
    svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
    svg.replaceChildren();
    const n = Math.max(0, ...series.map((s) => s.values.length));
    const all = series.flatMap((s) => s.values.filter((v) => v !== null && v !== undefined));
    let top = opts && opts.max !== undefined ? opts.max : Math.max(0, ...all);
    if (!(top > 0)) top = 1;
    const fmt = (opts && opts.format) || num;
    for (let i = 0; i <= 4; i++) {
      const y = T + ((H - T - B) * i) / 4;
      const line = document.createElementNS(SVG, "line");
      for (const [k, v] of [["x1", L], ["x2", W - R], ["y1", y], ["y2", y], ["class", "grid"]]) line.setAttribute(k, v);
      svg.append(line);
      const label = document.createElementNS(SVG, "text");
      label.setAttribute("x", String(L - 4));
      label.setAttribute("y", String(y + 3));
      label.setAttribute("text-anchor", "end");
      label.setAttribute("class", "axis");
      label.textContent = fmt(top * (1 - i / 4));
      svg.append(label);
    }
    if (n === 0) {
      const t = document.createElementNS(SVG, "text");
      t.setAttribute("x", String(W / 2));
      t.setAttribute("y", String(H / 2));
      t.setAttribute("text-anchor", "middle");
      t.setAttribute("class", "axis");
      t.textContent = "no data yet";
      svg.append(t);
      return;
    }
    const x = (i) => L + ((W - L - R) * (n === 1 ? 1 : i / (n - 1)));
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

  return { el, setText, num, pct, secs, bytes, fillTable, lineChart, bars, poll };
})();
