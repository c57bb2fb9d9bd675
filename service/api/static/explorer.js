// Attention explorer (docs/explorer.md): calls POST v1/translate with return_attention and draws the
// weights of every layer and head. Plain browser JavaScript: no library, no build step.
//
// What tests read (tests/test_explorer.py):
//   canvas.heatmap[data-kind][data-layer][data-head]  one small multiple; data-matrix = the weights
//       drawn, [rows][cols] (rows: target tokens for cross/decoder, source tokens for encoder)
//   canvas.zoom / canvas.average                      the enlarged head / the layer average (same data-*)
//   .labels[data-axis=rows|cols] .tok                 the token labels of the enlarged view
//   #tooltip [data-weight]                            the hovered cell: its tokens and weight (DIGITS decimals)
//   body[data-ready] / body[data-done]                 set after start / counts finished translate calls
"use strict";
(function () {
  const KINDS = {
    cross: {rows: "tgt", cols: "src", title: "Cross-attention",
            about: "Rows: target tokens; columns: the source tokens each one attends to."},
    encoder: {rows: "src", cols: "src", title: "Encoder self-attention",
              about: "Rows and columns: source tokens."},
    decoder: {rows: "tgt", cols: "tgt", title: "Decoder self-attention (masked)",
              about: "Rows and columns: target tokens; a token never sees later ones (nothing above the diagonal)."},
  };
  const DIGITS = 4;          // decimals of a weight in the tooltip (the API sends 5)
  const MINI_PX = 92;        // the longer side of a small multiple, CSS pixels
  const ZOOM_PX = 520;       // the longer side of the enlarged view, before the cell size clamps
  const KEY_STORE = "mt-api-key";
  const KEY_COOKIE = "mt_api_key";
  const EXAMPLES = [
    "Zwei Hunde spielen im Schnee.",
    "Ein Mann fährt mit dem Fahrrad die Straße entlang. Zwei Hunde spielen im Schnee.",
    "Eine Frau in einem roten Mantel sitzt auf einer Bank und liest ein Buch.",
    "Ein kleines Mädchen klettert in ein Spielhaus aus Holz. Ihr Vater steht daneben. Es regnet.",
    "Eine Gruppe junger Leute sitzt an einem sonnigen Nachmittag auf der grünen Wiese vor dem alten " +
      "Rathaus, während ein Mann mit einem großen schwarzen Hut Gitarre spielt und zwei kleine Kinder " +
      "mit einem braunen Hund um den Brunnen herum laufen und dabei laut lachen.",
  ];
  // Blues, white at 0 so that masked and off-block cells stay empty
  const STOPS = [[0, 255, 255, 255], [0.25, 198, 219, 239], [0.5, 107, 174, 214], [0.75, 33, 113, 181],
                 [1, 8, 48, 107]];

  const $ = (id) => document.getElementById(id);
  const state = {
    models: [], data: null, kind: "cross", sentence: -1, layer: 0, target: null,
    zoom: {cross: [0, 0], encoder: [0, 0], decoder: [0, 0]},
  };

  // ---- colours and drawing ------------------------------------------------------------------------
  function colour(w) {
    w = Math.max(0, Math.min(1, w));
    for (let i = 1; i < STOPS.length; i++) {
      if (w <= STOPS[i][0]) {
        const a = STOPS[i - 1], b = STOPS[i], t = (w - a[0]) / (b[0] - a[0]);
        return [0, 1, 2].map((c) => Math.round(a[c + 1] + t * (b[c + 1] - a[c + 1])));
      }
    }
    return STOPS[STOPS.length - 1].slice(1);
  }

  // One pixel per cell; CSS scales the canvas up (image-rendering: pixelated), so 60+ tokens stay fast.
  // Rows other than `emph` are faded when a row is emphasised.
  function paint(canvas, m, emph) {
    const rows = m.length, cols = rows ? m[0].length : 0;
    canvas.width = Math.max(cols, 1);
    canvas.height = Math.max(rows, 1);
    const ctx = canvas.getContext("2d");
    const img = ctx.createImageData(canvas.width, canvas.height);
    for (let r = 0; r < rows; r++) {
      const fade = emph !== null && emph !== undefined && r !== emph;
      for (let c = 0; c < cols; c++) {
        const [R, G, B] = colour(m[r][c]), k = 4 * (r * cols + c);
        img.data[k] = fade ? 255 - (255 - R) * 0.25 : R;
        img.data[k + 1] = fade ? 255 - (255 - G) * 0.25 : G;
        img.data[k + 2] = fade ? 255 - (255 - B) * 0.25 : B;
        img.data[k + 3] = 255;
      }
    }
    ctx.putImageData(img, 0, 0);
  }

  function heatmap(cls, kind, layer, head, m, rowToks, colToks, cell) {
    const c = document.createElement("canvas");
    c.className = cls;
    Object.assign(c.dataset, {kind, layer: String(layer), head: String(head), rows: String(m.length),
                              cols: String(m.length ? m[0].length : 0), matrix: JSON.stringify(m)});
    c._m = m; c._rows = rowToks; c._cols = colToks;
    c.style.width = `${Math.max(colToks.length, 1) * cell}px`;
    c.style.height = `${Math.max(rowToks.length, 1) * cell}px`;
    paint(c, m, null);
    return c;
  }

  // ---- the data of one response ----------------------------------------------------------------------
  function sliceRows(m, r0, r1, c0, c1) { return m.slice(r0, r1).map((row) => row.slice(c0, c1)); }

  function mean(mats) {
    if (!mats.length || !mats[0].length) return [];
    return mats[0].map((row, r) => row.map((_, c) => mats.reduce((s, m) => s + m[r][c], 0) / mats.length));
  }

  function argmax(row) {
    let best = 0;
    row.forEach((w, i) => { if (w > row[best]) best = i; });
    return best;
  }

  // Sentences: source sentences end in </s>; a target token belongs to the sentence whose source
  // block holds its cross-attention (the weights are block-diagonal over sentences).
  function sentences(src, tgt, cross) {
    const srcS = [];
    let start = 0;
    src.forEach((t, i) => { if (t === "</s>") { srcS.push([start, i + 1]); start = i + 1; } });
    if (start < src.length) srcS.push([start, src.length]);
    const of = (i) => srcS.findIndex(([a, b]) => i >= a && i < b);
    const first = cross && cross.length ? cross[0][0] : [];
    const tgtOf = tgt.map((_, t) => (first[t] ? of(argmax(first[t])) : 0));
    let prev = 0;
    const tgtS = srcS.map((_, k) => {
      const idx = tgtOf.map((s, t) => (s === k ? t : -1)).filter((t) => t >= 0);
      const range = idx.length ? [idx[0], idx[idx.length - 1] + 1] : [prev, prev];
      prev = range[1];
      return range;
    });
    return {srcS, tgtS};
  }

  function view(kind) {
    const d = state.data, k = state.sentence;
    const [s0, s1] = k < 0 ? [0, d.src.length] : d.srcS[k];
    const [t0, t1] = k < 0 ? [0, d.tgt.length] : d.tgtS[k];
    const r = KINDS[kind].rows === "src" ? [s0, s1] : [t0, t1];
    const c = KINDS[kind].cols === "src" ? [s0, s1] : [t0, t1];
    const toks = (axis, [a, b]) => (axis === "src" ? d.src : d.tgt).slice(a, b);
    return {r0: r[0], r1: r[1], c0: c[0], c1: c[1], rowToks: toks(KINDS[kind].rows, r),
            colToks: toks(KINDS[kind].cols, c)};
  }

  function matrix(kind, layer, head, v) {
    return sliceRows(state.data.att[kind][layer][head], v.r0, v.r1, v.c0, v.c1);
  }

  function layerMean(kind, layer, v) {
    return mean(state.data.att[kind][layer].map((_, h) => matrix(kind, layer, h, v)));
  }

  // ---- rendering -------------------------------------------------------------------------------------
  function el(tag, props, ...children) {
    const e = document.createElement(tag);
    Object.assign(e, props || {});
    children.forEach((c) => e.append(c));
    return e;
  }

  function labelled(canvas, kind, v, cell, big) {
    const font = `${Math.max(7, Math.min(13, cell - 2))}px`;
    const mk = (axis, toks, offset) => {
      const box = el("div", {className: `labels labels-${axis}`});
      box.dataset.axis = axis;
      toks.forEach((t, i) => {
        const s = el("span", {className: "tok", textContent: t, title: t});
        s.dataset.index = String(offset + i);
        s.style[axis === "rows" ? "height" : "width"] = `${cell}px`;
        s.style.fontSize = font;
        if (axis === "rows" && KINDS[kind].rows === "tgt") {
          s.classList.add("pick");
          if (state.target === offset + i) s.classList.add("picked");
          s.addEventListener("click", () => pickTarget(offset + i));
        }
        box.append(s);
      });
      return box;
    };
    const wrap = el("div", {className: "matrix" + (big ? " big" : "")});
    wrap.append(el("div", {className: "corner"}), mk("cols", v.colToks, v.c0), mk("rows", v.rowToks, v.r0), canvas);
    return wrap;
  }

  function renderPanel(kind) {
    const d = state.data, att = d.att[kind], v = view(kind);
    const panel = el("section", {className: "panel", hidden: kind !== state.kind});
    panel.dataset.kind = kind;
    panel.append(el("h2", {textContent: KINDS[kind].title}), el("p", {className: "about", textContent: KINDS[kind].about}));
    if (!att || !att.length || !v.rowToks.length || !v.colToks.length) {
      panel.append(el("p", {className: "empty", textContent: "No weights to show (no tokens in this view)."}));
      return panel;
    }
    const L = att.length, H = att[0].length, layer = Math.min(state.layer, L - 1);
    const n = Math.max(v.rowToks.length, v.colToks.length);
    // small multiples: layers x heads
    const grid = el("div", {className: "minis"});
    grid.style.gridTemplateColumns = `auto repeat(${H}, auto)`;
    grid.append(el("span"));
    for (let h = 0; h < H; h++) grid.append(el("span", {className: "colhead", textContent: `head ${h}`}));
    const [zl, zh] = state.zoom[kind];
    const emph = KINDS[kind].rows === "tgt" && state.target !== null ? state.target - v.r0 : null;
    for (let l = 0; l < L; l++) {
      grid.append(el("span", {className: "rowhead", textContent: `layer ${l}`}));
      for (let h = 0; h < H; h++) {
        const m = matrix(kind, l, h, v);
        const c = heatmap("heatmap", kind, l, h, m, v.rowToks, v.colToks, MINI_PX / n);
        if (emph !== null && emph >= 0 && emph < m.length) paint(c, m, emph);
        const fig = el("figure", {className: "mini" + (l === zl && h === zh ? " chosen" : "")}, c);
        fig.title = `layer ${l}, head ${h}: click to enlarge`;
        if (emph !== null && emph >= 0 && emph < m.length) {
          const j = argmax(m[emph]);
          fig.append(el("figcaption", {className: "top", textContent: `${v.colToks[j]} ${m[emph][j].toFixed(2)}`}));
        }
        fig.addEventListener("click", () => { state.zoom[kind] = [l, h]; render(); });
        grid.append(fig);
      }
    }
    panel.append(grid);
    // the enlarged head and the layer average
    const cell = Math.max(8, Math.min(28, Math.floor(ZOOM_PX / n)));
    const zoom = heatmap("zoom", kind, zl, zh, matrix(kind, zl, zh, v), v.rowToks, v.colToks, cell);
    const avgM = layerMean(kind, layer, v);
    const avg = heatmap("average", kind, layer, "mean", avgM, v.rowToks, v.colToks, cell);
    const zoomView = labelled(zoom, kind, v, cell, true);
    if (emph !== null && emph >= 0 && emph < zoom._m.length) {   // shade the source tokens of the chosen row
      zoomView.querySelectorAll(".labels-cols .tok").forEach((s, j) => {
        s.style.background = `rgba(33, 113, 181, ${zoom._m[emph][j].toFixed(3)})`;
      });
    }
    panel.append(el("div", {className: "detail"},
      el("figure", {}, el("figcaption", {textContent: `layer ${zl}, head ${zh}`}), zoomView),
      el("figure", {}, el("figcaption", {textContent: `layer ${layer}, average of ${H} heads`}),
         labelled(avg, kind, v, cell, true))));
    if (kind === "cross") panel.append(alignment(avgM, v, layer));
    return panel;
  }

  // Word alignment: for each target token, a line to the source token of highest layer-average weight.
  function alignment(avgM, v, layer) {
    const NS = "http://www.w3.org/2000/svg";
    const step = 26, pad = 20, top = 90, bottom = 190;
    const width = pad * 2 + step * Math.max(v.colToks.length, v.rowToks.length);
    const svg = document.createElementNS(NS, "svg");
    svg.setAttribute("class", "alignment");
    svg.setAttribute("width", width);
    svg.setAttribute("height", bottom + 90);
    const xs = (n, i) => pad + (i + 0.5) * (width - 2 * pad) / n;
    const text = (x, y, s, angle, cls) => {
      const t = document.createElementNS(NS, "text");
      t.setAttribute("transform", `translate(${x},${y}) rotate(${angle})`);
      t.setAttribute("class", cls);
      t.textContent = s;
      svg.append(t);
      return t;
    };
    avgM.forEach((row, i) => {
      const j = argmax(row), line = document.createElementNS(NS, "line");
      Object.entries({x1: xs(v.rowToks.length, i), y1: bottom, x2: xs(v.colToks.length, j), y2: top,
                      "stroke-width": 1 + 3 * row[j], "stroke-opacity": 0.25 + 0.75 * row[j]})
        .forEach(([k, val]) => line.setAttribute(k, val));
      line.setAttribute("class", "link" + (state.target === v.r0 + i ? " picked" : ""));
      Object.assign(line.dataset, {target: String(v.r0 + i), source: String(v.c0 + j), weight: String(row[j])});
      svg.append(line);
    });
    v.colToks.forEach((s, j) => text(xs(v.colToks.length, j), top - 6, s, -45, "src"));
    v.rowToks.forEach((s, i) => {
      const t = text(xs(v.rowToks.length, i), bottom + 12, s, 45, "tgt" + (state.target === v.r0 + i ? " picked" : ""));
      t.addEventListener("click", () => pickTarget(v.r0 + i));
    });
    return el("figure", {className: "align"},
      el("figcaption", {textContent: `Word alignment: each target token (below) to its source token of ` +
                                     `highest weight (above), layer ${layer} average`}),
      el("div", {className: "scroll"}, svg));
  }

  function render() {
    const panels = $("panels");
    panels.replaceChildren(...Object.keys(KINDS).filter((k) => state.data.att[k]).map(renderPanel));
    document.querySelectorAll(".tabs button").forEach((b) => {
      b.setAttribute("aria-selected", String(b.dataset.tab === state.kind));
    });
  }

  function pickTarget(t) {
    state.target = state.target === t ? null : t;
    render();
  }

  // ---- the tooltip -------------------------------------------------------------------------------------
  function hover(ev) {
    const c = ev.target, tip = $("tooltip");
    if (!(c instanceof HTMLCanvasElement) || !c._m) { tip.hidden = true; return; }
    const box = c.getBoundingClientRect(), rows = c._m.length, cols = rows ? c._m[0].length : 0;
    const r = Math.floor((ev.clientY - box.top) / box.height * rows);
    const col = Math.floor((ev.clientX - box.left) / box.width * cols);
    if (r < 0 || r >= rows || col < 0 || col >= cols) { tip.hidden = true; return; }
    const w = c._m[r][col], k = KINDS[c.dataset.kind];
    const name = (axis) => (axis === "src" ? "source" : "target");
    const head = c.dataset.head === "mean" ? "average" : `head ${c.dataset.head}`;
    tip.replaceChildren(
      el("div", {className: "where", textContent: `layer ${c.dataset.layer}, ${head}`}),
      el("div", {textContent: `${name(k.rows)} ${c._rows[r]} → ${name(k.cols)} ${c._cols[col]}`}),
      el("div", {}, "weight ", el("b", {id: "tooltip-weight", textContent: w.toFixed(DIGITS)})));
    Object.assign(tip.dataset, {weight: String(w), row: String(r), col: String(col)});
    tip.hidden = false;
    tip.style.left = `${ev.pageX + 14}px`;
    tip.style.top = `${ev.pageY + 14}px`;
  }

  // ---- the API ---------------------------------------------------------------------------------------
  function headers() {
    const h = {"Content-Type": "application/json"}, key = localStorage.getItem(KEY_STORE);
    if (key) h.Authorization = `Bearer ${key}`;
    return h;
  }

  function plainError(status, body, retryAfter) {
    const msg = body && body.error ? (body.error.message || String(body.error)) : "";
    const wait = retryAfter ? ` Please try again in ${retryAfter} s.` : " Please try again in a moment.";
    switch (status) {
      case 401: return `This service needs an API key: enter yours under “API key” and try again. (${msg})`;
      case 404: return `The service does not serve this model or language pair. ${msg}`;
      case 413: return `The text is too long for the service. ${msg}`;
      case 422: return `The service did not accept the request. ${msg}`;
      case 429: return `Too many requests from this key or address.${wait}`;
      case 503: return `The service is overloaded or the model is still loading.${wait}`;
      case 504: return `The translation took longer than the service allows and was cancelled; try a shorter text. ${msg}`;
      default: return `The service answered with an error (HTTP ${status}). ${msg}`;
    }
  }

  async function call(path, init) {
    let resp;
    try {
      resp = await fetch(path, {...init, headers: headers()});
    } catch (e) {
      throw new Error(`Could not reach the service (${e.message}). Is it running?`);
    }
    let body = null;
    try { body = await resp.json(); } catch (e) { body = null; }
    if (!resp.ok) throw new Error(plainError(resp.status, body, resp.headers.get("Retry-After")));
    return body;
  }

  function showError(message) {
    $("error").textContent = message;
    $("error").hidden = !message;
  }

  async function loadModels() {
    const body = await call("v1/models", {method: "GET"});
    state.models = body.data;
    $("model").replaceChildren(...state.models.map((m) => el("option", {
      value: m.id, textContent: `${m.id} (${m.source_lang}→${m.target_lang || m.target_langs.join("/")})`})));
    modelChanged();
  }

  function modelChanged() {
    const m = state.models.find((x) => x.id === $("model").value);
    const many = m && !m.target_lang && m.target_langs.length > 0;
    $("target-box").hidden = !many;
    $("target").replaceChildren(...(many ? m.target_langs : []).map((t) => el("option", {value: t, textContent: t})));
  }

  function request() {
    const body = {text: $("text").value, model: $("model").value || undefined,
                  beam_size: Number($("beam").value || 4), return_attention: true,
                  attention: {kinds: Object.keys(KINDS)}};
    if ($("max-tokens").value !== "") body.max_new_tokens = Number($("max-tokens").value);
    if (!$("target-box").hidden) body.target_lang = $("target").value;
    return body;
  }

  function shareUrl(body) {
    const q = new URLSearchParams({text: body.text});
    if (body.model) q.set("model", body.model);
    q.set("beam_size", String(body.beam_size));
    if (body.max_new_tokens !== undefined) q.set("max_new_tokens", String(body.max_new_tokens));
    if (body.target_lang) q.set("target_lang", body.target_lang);
    return `${location.pathname}?${q}`;
  }

  async function translate(ev) {
    if (ev) ev.preventDefault();
    const body = request();
    showError("");
    $("status").textContent = "Translating…";
    $("translate").disabled = true;
    const t0 = performance.now();
    try {
      const resp = await call("v1/translate", {method: "POST", body: JSON.stringify(body)});
      show(resp, body);
      $("status").textContent = `Translated in ${((performance.now() - t0) / 1000).toFixed(2)} s.`;
      history.replaceState(null, "", shareUrl(body));
    } catch (e) {
      $("status").textContent = "";
      showError(e.message);
    } finally {
      $("translate").disabled = false;
      document.body.dataset.done = String(Number(document.body.dataset.done || 0) + 1);   // tests wait on it
    }
  }

  function show(resp, body) {
    const tr = resp.translations[0], att = tr.attention || {};
    const {srcS, tgtS} = sentences(tr.source_tokens, tr.tokens, att.cross);
    state.data = {resp, src: tr.source_tokens, tgt: tr.tokens, att, srcS, tgtS};
    state.sentence = -1;
    state.target = null;
    state.zoom = {cross: [0, 0], encoder: [0, 0], decoder: [0, 0]};
    const L = Math.max(...Object.values(att).map((a) => a.length), 1);
    state.layer = L - 1;
    $("translation").textContent = tr.text;
    $("score").textContent = tr.score.toFixed(4);
    $("finish").textContent = tr.finish_reason;
    $("used-model").textContent = resp.model;
    const H = att.cross && att.cross.length ? att.cross[0].length : 0;
    $("sizes").textContent = `${tr.source_tokens.length} source tokens, ${tr.tokens.length} target tokens, ` +
                             `${(att.cross || []).length} layers × ${H} heads`;
    $("share").href = shareUrl(body);
    $("sentence-box").hidden = srcS.length < 2;
    $("sentence").replaceChildren(el("option", {value: "-1", textContent: `all ${srcS.length} sentences`}),
      ...srcS.map(([a, b], k) => el("option", {value: String(k),
        textContent: `${k + 1}: ${tr.source_tokens.slice(a, Math.min(b, a + 6)).join(" ")}${b - a > 6 ? " …" : ""}`})));
    $("layer").replaceChildren(...Array.from({length: L}, (_, l) => el("option", {value: String(l), textContent: `layer ${l}`})));
    $("layer").value = String(state.layer);
    $("result").hidden = false;
    render();
  }

  // ---- start -------------------------------------------------------------------------------------------
  function setKey(key) {
    localStorage.setItem(KEY_STORE, key);
    document.cookie = `${KEY_COOKIE}=${encodeURIComponent(key)}; path=/; SameSite=Strict`;
  }

  async function start() {
    EXAMPLES.forEach((t) => $("examples").append(el("option", {value: t, textContent: t.length > 60 ? t.slice(0, 57) + "…" : t})));
    $("examples").addEventListener("change", () => { if ($("examples").value) $("text").value = $("examples").value; });
    $("api-key").value = localStorage.getItem(KEY_STORE) || "";
    $("api-key").addEventListener("change", () => setKey($("api-key").value.trim()));
    $("model").addEventListener("change", modelChanged);
    $("form").addEventListener("submit", translate);
    $("sentence").addEventListener("change", () => { state.sentence = Number($("sentence").value); state.target = null; render(); });
    $("layer").addEventListener("change", () => { state.layer = Number($("layer").value); render(); });
    document.querySelectorAll(".tabs button").forEach((b) => b.addEventListener("click", () => {
      state.kind = b.dataset.tab;
      document.querySelectorAll("#panels .panel").forEach((p) => { p.hidden = p.dataset.kind !== state.kind; });
      document.querySelectorAll(".tabs button").forEach((x) => x.setAttribute("aria-selected", String(x === b)));
    }));
    document.addEventListener("mousemove", hover);
    const q = new URLSearchParams(location.search);
    try {
      await loadModels();
    } catch (e) {
      showError(e.message);
    }
    if (q.has("model")) {
      const id = q.get("model");
      if (!state.models.some((m) => m.id === id)) $("model").append(el("option", {value: id, textContent: `${id} (not served)`}));
      $("model").value = id;
      modelChanged();
    }
    if (q.has("target_lang")) $("target").value = q.get("target_lang");
    if (q.has("beam_size")) $("beam").value = q.get("beam_size");
    if (q.has("max_new_tokens")) $("max-tokens").value = q.get("max_new_tokens");
    if (q.has("text")) {
      $("text").value = q.get("text");
      await translate(null);
    }
    document.body.dataset.ready = "true";
  }

  start();
})();
