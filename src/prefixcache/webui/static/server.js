// prefixcache dashboard: the server's page (GET /v1/dashboard every two seconds).
"use strict";

function renderServer(d) {
  const t = d.totals;
  PC.setText("model", d.model);
  PC.setText("tenant", d.admin ? "tenant " + d.tenant + " (admin: every tenant's prefixes)" : "tenant " + d.tenant);
  PC.setText("uptime", "up " + Math.round(d.uptime_s) + " s");
  PC.setText("hit-rate", PC.pct(t.hit_rate), t.hit_rate);
  PC.setText("cached-tokens", PC.num(t.cached_tokens), t.cached_tokens);
  PC.setText("prefilled-tokens", PC.num(t.prefilled_tokens), t.prefilled_tokens);
  PC.setText("written-tokens", PC.num(t.written_tokens), t.written_tokens);
  PC.setText("requests", PC.num(t.requests), t.requests);
  PC.setText("prompt-tokens", PC.num(t.prompt_tokens) + " prompt tokens", t.prompt_tokens);
  PC.setText("queue-depth", PC.num(t.queue_depth), t.queue_depth);

  const s = d.series;
  const col = (name) => s.map((p) => p[name]);
  // Rolling windows of WINDOW points: per-interval values of sparse traffic are mostly gaps.
  const WINDOW = Math.max(1, Math.round(30 / d.interval_s));
  const windowSum = (name, i) => s.slice(Math.max(0, i - WINDOW + 1), i + 1).reduce((a, p) => a + p[name], 0);
  const rollingRate = s.map((_, i) => {
    const prompt = windowSum("prompt_tokens", i);
    return prompt > 0 ? windowSum("cached_tokens", i) / prompt : null;
  });
  const perSecond = (name) => s.map((_, i) => windowSum(name, i) / (Math.min(i + 1, WINDOW) * d.interval_s));
  // The chart spans what the series holds; each point averages the WINDOW before it.
  const span = s.length ? Math.max(0, d.now - s[0].t + d.interval_s) : 0;
  PC.setText("window", Math.round(WINDOW * d.interval_s) + " s");
  PC.setText("span", PC.ago(span).replace("-", ""));
  const axis = { times: col("t"), now: d.now };
  PC.lineChart("chart-hit-rate", [{ values: rollingRate }], { ...axis, max: 1, format: PC.pct });
  PC.lineChart("chart-tokens", [
    { values: perSecond("cached_tokens") }, { values: perSecond("prefilled_tokens") }, { values: perSecond("written_tokens") },
  ], axis);
  PC.lineChart("chart-ttft", [
    { values: col("ttft_hit_per_1k_s") }, { values: col("ttft_miss_per_1k_s") }, { values: col("ttft_partial_per_1k_s") },
  ], { ...axis, format: PC.secs });
  PC.lineChart("chart-queue", [{ values: col("queue_depth") }], axis);

  // Hits against misses of prompts of about one length (a short miss beats a long hit).
  const cell = (o) => [o.count ? PC.secs(o.p50_s) + " (" + PC.num(o.count) + ")" : "–", "num"];
  PC.fillTable("ttft-table", (d.ttft_by_length || []).map((b) => [
    b.max_tokens ? PC.num(b.min_tokens) + "–" + PC.num(b.max_tokens - 1) : "≥ " + PC.num(b.min_tokens),
    cell(b.hit), cell(b.partial), cell(b.miss),
  ]), "no requests yet", 4);

  PC.setText("top-title", d.admin ? "Top prefixes by tokens saved (every tenant)" : "Top prefixes by tokens saved (tenant " + d.tenant + ")");
  PC.fillTable("top-prefixes", d.top_prefixes.map((p) => [
    [p.key.slice(0, 16), "key"], p.tenant, [PC.num(p.tokens_saved), "num"], [PC.num(p.hits), "num"],
    [PC.num(p.prefix_tokens), "num"], [p.preview, "preview"],
  ]), "no hits yet", 6);

  const reasons = Object.entries(d.miss_reasons || {}).sort((a, b) => b[1] - a[1]);
  PC.bars("miss-reasons", reasons);
  PC.fillTable("busting", (d.busting || []).map((f) => [
    f.tenant, f.endpoint, f.kind, [PC.num(f.start_token), "num"], [PC.num(f.tokens_lost_per_request), "num"],
    [PC.pct(f.share_of_requests), "num"], [(f.examples || []).join(" · "), "preview"],
  ]), "no data yet", 7);

  PC.fillTable("tiers", (d.tiers || []).map((r) => [
    r.name, [PC.pct(r.hit_rate), "num"], [PC.num(r.hits), "num"], [PC.num(r.misses), "num"],
    [PC.num(r.errors), "num"], [PC.num(r.corrupt), "num"], [PC.num(r.write_drops), "num"],
    [PC.num(r.entries), "num"], [PC.bytes(r.bytes), "num"],
  ]), "memory only (no disk or Redis tier)", 9);

  const c = d.cache;
  const rows = c.enabled ? [
    ["blocks held", [PC.num(c.blocks), "num"]],
    ["bytes held", [PC.bytes(c.bytes) + " of " + PC.bytes(c.capacity_bytes), "num"]],
    ["pinned blocks", [PC.num(c.pinned_blocks), "num"]],
    ...Object.entries(c.evictions).map(([r, n]) => ["evicted (" + r + ")", [PC.num(n), "num"]]),
  ] : [];
  if (d.tenant_cache) {
    rows.push(["your tenant's hit rate", [PC.pct(d.tenant_cache.hit_rate), "num"]]);
    rows.push(["your tenant's blocks", [PC.num(d.tenant_cache.blocks), "num"]]);
  }
  if (d.verify) {  // the exactness audit: sampled hits recomputed and compared bit for bit
    const v = d.verify.verified;
    rows.push(["exactness audit", [d.verify.degraded ? "a hit differed (see /v1/cache/verify)" : "ok", "num"]]);
    rows.push(["hits verified equal / differ", [PC.num(v.equal) + " / " + PC.num(v.differ), "num"]]);
  }
  PC.fillTable("cache-table", rows, "the prompt cache is off", 2);
}

document.addEventListener("DOMContentLoaded", () => PC.poll("/v1/dashboard", 2000, renderServer));
