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

  const col = (name) => d.series.map((p) => p[name]);
  PC.lineChart("chart-hit-rate", [{ values: col("hit_rate") }], { max: 1, format: PC.pct });
  PC.lineChart("chart-load", [{ values: col("routed") }, { values: col("in_flight") }]);
}

document.addEventListener("DOMContentLoaded", () => PC.poll("/router/dashboard", 2000, renderRouter));
