// prefixcache dashboard: the router's page (GET /router/dashboard every two seconds).
"use strict";

function renderRouter(d) {
  const t = d.totals;
  PC.setText("policy", "policy " + d.policy);
  PC.setText("hit-rate", PC.pct(t.hit_rate), t.hit_rate);
  PC.setText("healthy", t.healthy + " / " + t.replicas, t.healthy);
  PC.setText("replica-count", t.replicas + " replicas configured", t.replicas);
  PC.setText("in-flight", PC.num(t.in_flight), t.in_flight);
  PC.setText("routed", PC.num(t.routed), t.routed);
  PC.setText("failovers", PC.num(t.failovers), t.failovers);
  PC.setText("load-fallbacks", PC.num(t.load_fallbacks) + " load fall-backs", t.load_fallbacks);
  PC.setText("record-entries", PC.num(t.record_entries), t.record_entries);

  PC.fillTable("replicas", d.replicas.map((r) => [
    [r.url, "key"], r.healthy ? ["up", "healthy"] : ["down", "down"], [PC.num(r.in_flight), "num"],
    [PC.num(r.routed), "num"], [PC.num(r.completed), "num"], [PC.num(r.failed), "num"],
    [PC.pct(r.hit_rate), "num"], [PC.num(r.prompt_tokens), "num"], [PC.num(r.cached_tokens), "num"],
    [PC.num(r.prefixes), "num"], [r.last_error || "", "preview"],
  ]), "no replicas", 11);

  const s = d.series;
  const col = (name) => s.map((p) => p[name]);
  const WINDOW = Math.max(1, Math.round(30 / d.interval_s));
  const windowSum = (name, i) => s.slice(Math.max(0, i - WINDOW + 1), i + 1).reduce((a, p) => a + p[name], 0);
  const rollingRate = s.map((_, i) => {
    const prompt = windowSum("prompt_tokens", i);
    return prompt > 0 ? windowSum("cached_tokens", i) / prompt : null;
  });
  PC.setText("window", Math.round(WINDOW * d.interval_s) + " s");
  const axis = s.length && s[0].t !== undefined ? { times: col("t") } : {};
  PC.lineChart("chart-hit-rate", [{ values: rollingRate }], { ...axis, max: 1, format: PC.pct });
  const perSecond = (name) => s.map((_, i) => windowSum(name, i) / (Math.min(i + 1, WINDOW) * d.interval_s));
  PC.lineChart("chart-load", [{ values: perSecond("routed") }, { values: col("in_flight") }], axis);
}

document.addEventListener("DOMContentLoaded", () => PC.poll("/router/dashboard", 2000, renderRouter));
