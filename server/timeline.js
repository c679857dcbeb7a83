"use strict";
// The page's timeline: the engine's moments after each pass (GET /timeline), plotted, and replayed by the slider.
// It shares page.html's $, colour and headers; page.html calls pullTimeline and drawTimeline as it refreshes.
const timeline = {moments: [], kept: 600, seq: 0};  // kept: the server's bound, which the page keeps too
const lastSeen = new Map();  // each request's counts at the last moment it was in
const LIGHTNESS = {waiting: 88, prefilling: 68, decoding: 45};  // preempted is drawn red
const LANES = 12;  // the newest requests that get a lane
let replayed = null;  // the pass the pool shows, or null while it follows the engine

async function pullTimeline() {
  const response = await fetch(`/timeline?since=${timeline.seq}`, {headers: headers()});
  if (!response.ok) return;
  const answer = await response.json();
  timeline.kept = answer.moments_kept;
  for (const moment of answer.moments.filter(m => m.seq > timeline.seq)) {
    timeline.moments.push(moment);
    for (const r of moment.requests) lastSeen.set(r.id, r);
  }
  timeline.moments.splice(0, Math.max(0, timeline.moments.length - timeline.kept));
  while (lastSeen.size > 4 * timeline.kept) lastSeen.delete(lastSeen.keys().next().value);
  if (!timeline.moments.length) return;
  timeline.seq = timeline.moments.at(-1).seq;
  const slider = $("scrubber"), first = timeline.moments[0].seq;
  slider.min = first; slider.max = timeline.seq;
  if (replayed !== null && replayed < first) replayed = first;  // its moment was dropped: the oldest kept
  slider.value = replayed === null ? timeline.seq : replayed;
}

function scrub() {
  const slider = $("scrubber");
  replayed = Number(slider.value) >= Number(slider.max) ? null : Number(slider.value);
  showMoment();
}

function shownMoment() {
  return replayed === null ? timeline.moments.at(-1) : timeline.moments.find(m => m.seq >= replayed);
}

function showMoment() {
  const m = shownMoment();
  if (!m) return;
  if (replayed !== null) drawPool(m.blocks);
  const what = `${m.used} blocks in use, ${m.shared} shared, ${m.cached} cached; ${m.requests.length} requests`;
  $("moment").textContent = replayed === null ? `live: after pass ${m.seq}, ${what}` :
    `replaying pass ${m.seq}, ${(timeline.moments.at(-1).seconds - m.seconds).toFixed(1)} s before the last: ` +
    `${what}. Drag to the right end to follow the engine again.`;
  $("moment").dataset.used = m.used;
}

function sized(id) {  // a canvas as wide as it is drawn, cleared
  const canvas = $(id);
  canvas.width = canvas.clientWidth || 600;
  const g = canvas.getContext("2d");
  g.clearRect(0, 0, canvas.width, canvas.height);
  return [g, canvas.width, canvas.height];
}

function drawTimeline(pool) {
  const moments = timeline.moments, n = moments.length;
  showMoment();
  drawWords(pool);
  const [g, w, h] = sized("chart");
  const top = Math.max(1, ...moments.map(m => m.used + m.cached));  // the most the kept passes reach
  const x = (i) => (n > 1 ? i * (w - 2) / (n - 1) : 0) + 1;
  const y = (v) => h - 2 - v / top * (h - 14);
  g.fillStyle = "#555"; g.font = "11px system-ui"; g.fillText(`${top} blocks`, 6, 20);
  for (const [field, style] of [["cached", "#aaa"], ["used", "#233"], ["shared", "#e80"]]) {
    g.strokeStyle = style; g.lineWidth = 2; g.beginPath();
    moments.forEach((m, i) => (i ? g.lineTo(x(i), y(m[field])) : g.moveTo(x(i), y(m[field]))));
    g.stroke();
  }
  g.fillStyle = "#2a2";
  moments.forEach((m, i) => { if (m.hits.length) g.fillRect(x(i) - 2, 0, 4, 8); });
  const shown = moments.indexOf(shownMoment());
  if (shown >= 0) { g.fillStyle = "#000"; g.fillRect(x(shown) - 1, 0, 2, h); }
  drawLives(moments, x, shown);
}

function drawLives(moments, x, shown) {
  const [g, w, h] = sized("lives");
  const ids = [...new Set(moments.flatMap(m => m.requests.map(r => r.id)))].slice(-LANES);
  const lane = h / LANES, step = moments.length > 1 ? w / (moments.length - 1) : w;
  moments.forEach((m, i) => {
    for (const r of m.requests) {
      const row = ids.indexOf(r.id);
      if (row < 0) continue;
      g.fillStyle = r.state === "preempted" ? "#d33" : colour(r.id, LIGHTNESS[r.state]);
      g.fillRect(x(i), row * lane, step + 1, lane - 2);
    }
  });
  if (shown >= 0) { g.fillStyle = "#000"; g.fillRect(x(shown) - 1, 0, 2, h); }
}

function drawWords(pool) {
  const used = pool.blocks.filter(b => b[1] > 0).length;
  const hits = timeline.moments.reduce((sum, m) => sum + m.hits.length, 0);
  $("wordblocks").textContent = `Paged blocks: each request's keys and values fill blocks of ${pool.block_tokens} ` +
    `tokens from one pool, taken as it grows. ${used} of ${pool.blocks.length} are in use.`;
  $("wordhits").textContent = "Prefix hits: a prompt that begins like an earlier one reads its cached blocks, " +
    `not computing them. ${hits} in this timeline.`;
  $("wordpreemption").textContent = "Preemption: when the pool runs out, the newest request gives back its " +
    `blocks and waits to compute them again. ${pool.preemptions} so far.`;
  $("wordrate").textContent = `Hit rate: ${(100 * pool.hit_rate).toFixed(0)}% of prompt tokens were read from ` +
    "the cache, not computed.";
}
