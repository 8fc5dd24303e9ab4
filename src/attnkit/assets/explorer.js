/* attnkit attention explorer: head view (SVG lines) and model view (canvas heatmaps).
 * Self-contained, no dependencies. Reads the weights embedded in <script id="attn-data">.
 * Layout of the weights: layer-major, then head, query (row), key (column).
 * Everything drawn carries its weight in data attributes so that tests can check it. */
(function () {
  "use strict";

  const D = JSON.parse(document.getElementById("attn-data").textContent);
  const NL = D.layers, NH = D.heads, L = D.L, S = D.S;
  const SVG_NS = "http://www.w3.org/2000/svg";

  // ------------------------------------------------------------------ decoding the weights
  function base64Bytes(text) {
    const bin = atob(text);
    const out = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
    return out;
  }

  function halfTable() {
    // every IEEE binary16 bit pattern -> its value (subnormals included)
    const table = new Float32Array(65536);
    for (let h = 0; h < 65536; h++) {
      const sign = h & 0x8000 ? -1 : 1, exp = (h >> 10) & 0x1f, frac = h & 0x3ff;
      if (exp === 0) table[h] = sign * frac * Math.pow(2, -24);
      else if (exp === 31) table[h] = frac ? NaN : sign * Infinity;
      else table[h] = sign * (1 + frac / 1024) * Math.pow(2, exp - 15);
    }
    return table;
  }

  function decode() {
    const bytes = base64Bytes(D.data);
    const n = NL * NH * L * S;
    const w = new Float32Array(n);
    if (D.encoding === "float16") {
      const half = new Uint16Array(bytes.buffer, 0, n); // little-endian, as written by attnkit
      const table = halfTable();
      for (let i = 0; i < n; i++) w[i] = table[half[i]];
    } else {
      const size = L * S;
      for (let m = 0; m < NL * NH; m++) {
        const scale = D.scales[Math.floor(m / NH)][m % NH] / 255;
        for (let i = m * size; i < (m + 1) * size; i++) w[i] = bytes[i] * scale;
      }
    }
    return w;
  }

  const W = decode();
  function weight(l, h, i, j) { return W[((l * NH + h) * L + i) * S + j]; }
  const mapMax = [];
  for (let l = 0; l < NL; l++) {
    const row = [];
    for (let h = 0; h < NH; h++) {
      let m = 0;
      const base = (l * NH + h) * L * S;
      for (let k = base; k < base + L * S; k++) if (W[k] > m) m = W[k];
      row.push(m);
    }
    mapMax.push(row);
  }

  // ------------------------------------------------------------------ colours
  const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
    "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#ad494a", "#637939", "#8c6d31", "#7b4173",
    "#3182bd"];
  function headColour(h) {
    if (h < PALETTE.length) return PALETTE[h];
    return "hsl(" + Math.round((h * 137.508) % 360) + ", 65%, 45%)";
  }
  const VIRIDIS = [[0x44, 0x01, 0x54], [0x47, 0x2d, 0x7b], [0x3b, 0x52, 0x8b], [0x2c, 0x72, 0x8e],
    [0x21, 0x91, 0x8c], [0x28, 0xae, 0x80], [0x5e, 0xc9, 0x62], [0xad, 0xdc, 0x30],
    [0xfd, 0xe7, 0x25]];
  const LUT = new Uint8Array(256 * 3);
  for (let k = 0; k < 256; k++) {
    const x = (k / 255) * (VIRIDIS.length - 1), a = Math.min(Math.floor(x), VIRIDIS.length - 2);
    const t = x - a;
    for (let c = 0; c < 3; c++) LUT[k * 3 + c] = Math.round(VIRIDIS[a][c] * (1 - t) + VIRIDIS[a + 1][c] * t);
  }

  function shown(token) {
    if (token === "") return "\u2205";
    return token.replace(/\n/g, "\u21b5").replace(/^ +| +$/g, (m) => "\u2423".repeat(m.length));
  }
  function fmt(w) { return w.toFixed(4); }

  // ------------------------------------------------------------------ state
  const state = {
    layer: D.initialLayer || 0,
    heads: new Set(Array.from({ length: NH }, (_, h) => h)),
    hover: null, // {side: "q" | "k", index}
    pinned: null,
    relative: S > 24,
    detail: null, // {layer, head}
  };

  // ------------------------------------------------------------------ head view
  const svg = document.getElementById("head-svg");
  const big = Math.max(L, S);
  const rowH = big > 128 ? 12 : big > 48 ? 15 : 20;
  const fontPx = Math.max(9, rowH - 6);
  const measure = document.createElement("canvas").getContext("2d");
  measure.font = fontPx + "px sans-serif";
  function columnWidth(tokens, title) {
    let m = measure.measureText(title).width * 12 / fontPx; // titles are drawn at 12px
    for (const t of tokens) m = Math.max(m, measure.measureText(shown(t)).width);
    for (const t of tokens) m = Math.max(m, measure.measureText(shown(t)).width);
    return Math.min(Math.ceil(m) + 12, 200);
  }
  const Q_TITLE = "query (attends)", K_TITLE = "key (attended to)";
  const qW = columnWidth(D.queryTokens, Q_TITLE), kW = columnWidth(D.keyTokens, K_TITLE);
  const gap = big > 128 ? 360 : 280;
  const pad = 8, top = 24;
  const xLineStart = pad + qW + 4, xLineEnd = xLineStart + gap;
  const svgWidth = xLineEnd + 4 + kW + pad;
  const svgHeight = top + big * rowH + pad;
  svg.setAttribute("width", svgWidth);
  svg.setAttribute("height", svgHeight);
  svg.setAttribute("viewBox", "0 0 " + svgWidth + " " + svgHeight);

  function el(name, attrs, parent) {
    const node = document.createElementNS(SVG_NS, name);
    for (const key in attrs) node.setAttribute(key, attrs[key]);
    if (parent) parent.appendChild(node);
    return node;
  }
  function rowY(index, count) { // centre the shorter column against the longer one
    return top + (big - count) * rowH / 2 + index * rowH + rowH / 2;
  }

  el("text", { x: pad + qW - 4, y: 14, "text-anchor": "end", class: "column-title" }, svg)
    .textContent = Q_TITLE;
  el("text", { x: xLineEnd + 4 + 4, y: 14, class: "column-title" }, svg)
    .textContent = K_TITLE;
  const linesGroup = el("g", { id: "lines" }, svg);
  const tokenNodes = { q: [], k: [] };
  function addTokens(side, tokens, x, width, anchor) {
    const group = el("g", { id: side === "q" ? "query-tokens" : "key-tokens" }, svg);
    tokens.forEach((token, index) => {
      const y = rowY(index, tokens.length);
      const g = el("g", { class: "token", "data-side": side, "data-index": index, tabindex: 0 }, group);
      el("rect", { x: x, y: y - rowH / 2 + 1, width: width, height: rowH - 2, rx: 3 }, g);
      const text = el("text", {
        x: anchor === "end" ? x + width - 6 : x + 6, y: y, "text-anchor": anchor,
        "dominant-baseline": "central", "font-size": fontPx,
      }, g);
      text.textContent = shown(token);
      el("title", {}, g).textContent = (side === "q" ? "query " : "key ") + index + ": " + token;
      g.addEventListener("mouseenter", () => { state.hover = { side: side, index: index }; drawLines(); });
      g.addEventListener("mouseleave", () => { state.hover = null; drawLines(); });
      g.addEventListener("click", () => {
        const same = state.pinned && state.pinned.side === side && state.pinned.index === index;
        state.pinned = same ? null : { side: side, index: index };
        drawLines();
      });
      g.addEventListener("keydown", (event) => {
        if (event.key === "Enter" || event.key === " ") { event.preventDefault(); g.dispatchEvent(new Event("click")); }
      });
      tokenNodes[side].push(g);
    });
  }
  addTokens("q", D.queryTokens, pad, qW, "end");
  addTokens("k", D.keyTokens, xLineEnd + 4, kW, "start");

  function activeHeads() { return Array.from(state.heads).sort((a, b) => a - b); }
  function headOffset(h, heads) { // fan the heads out a little so that their lines stay apart
    if (heads.length < 2) return 0;
    const spread = rowH * 0.5;
    return (heads.indexOf(h) / (heads.length - 1) - 0.5) * spread;
  }

  function addLine(h, heads, i, j, w, opacity, cls) {
    const line = el("line", {
      x1: xLineStart, y1: rowY(i, L) + headOffset(h, heads),
      x2: xLineEnd, y2: rowY(j, S) + headOffset(h, heads),
      stroke: headColour(h), "stroke-opacity": opacity.toFixed(4),
      "stroke-width": (0.6 + 3.4 * opacity).toFixed(3), class: cls,
      "data-layer": state.layer, "data-head": h, "data-query": i, "data-key": j,
      "data-weight": w, "data-opacity": opacity,
    }, linesGroup);
    el("title", {}, line).textContent = "head " + h + ": " + shown(D.queryTokens[i]) + " \u2192 " +
      shown(D.keyTokens[j]) + "  " + fmt(w);
  }

  const selectionInfo = document.getElementById("selection-info");
  function drawLines() {
    linesGroup.textContent = "";
    const sel = state.hover || state.pinned;
    for (const side of ["q", "k"]) {
      tokenNodes[side].forEach((node, index) => {
        node.classList.toggle("selected", !!sel && sel.side === side && sel.index === index);
        node.classList.toggle("pinned", !!state.pinned && state.pinned.side === side && state.pinned.index === index);
      });
    }
    const heads = activeHeads();
    svg.dataset.layer = state.layer;
    svg.dataset.heads = heads.join(",");
    svg.dataset.selection = sel ? sel.side + ":" + sel.index : "";
    if (!sel) {
      selectionInfo.textContent = "";
      if (L * S * heads.length <= 4096) { // small inputs: a faint overview of every line
        for (const h of heads) {
          for (let i = 0; i < L; i++) {
            for (let j = 0; j < S; j++) {
              const w = weight(state.layer, h, i, j);
              if (w >= 0.02) addLine(h, heads, i, j, w, 0.35 * w, "overview");
            }
          }
        }
      }
      return;
    }
    const summary = [];
    for (const h of heads) {
      const count = sel.side === "q" ? S : L;
      const values = new Float32Array(count);
      let best = 0;
      for (let t = 0; t < count; t++) {
        values[t] = sel.side === "q" ? weight(state.layer, h, sel.index, t) : weight(state.layer, h, t, sel.index);
        if (values[t] > values[best]) best = t;
      }
      const peak = values[best] > 0 ? values[best] : 1;
      for (let t = 0; t < count; t++) {
        const w = values[t];
        const opacity = state.relative ? w / peak : w;
        if (opacity < 0.01) continue; // invisible anyway; keeps 512-token views light
        if (sel.side === "q") addLine(h, heads, sel.index, t, w, opacity, "focus");
        else addLine(h, heads, t, sel.index, w, opacity, "focus");
      }
      const other = sel.side === "q" ? D.keyTokens[best] : D.queryTokens[best];
      summary.push("head " + h + ": " + shown(other) + " (" + values[best].toFixed(2) + ")");
    }
    const token = sel.side === "q" ? D.queryTokens[sel.index] : D.keyTokens[sel.index];
    selectionInfo.textContent = (sel.side === "q" ? "Query " : "Key ") + sel.index + " \u201c" +
      shown(token) + "\u201d, " + D.layerNames[state.layer] + (sel.side === "q" ?
      " \u2014 attends most to: " : " \u2014 attended most by: ") + (summary.join("; ") || "no head selected");
  }

  // controls
  const layerSelect = document.getElementById("layer-select");
  D.layerNames.forEach((name, l) => {
    const option = document.createElement("option");
    option.value = l;
    option.textContent = name;
    layerSelect.appendChild(option);
  });
  layerSelect.value = String(state.layer);
  layerSelect.addEventListener("change", () => { state.layer = Number(layerSelect.value); drawLines(); });
  const toggles = document.getElementById("head-toggles");
  const toggleButtons = [];
  for (let h = 0; h < NH; h++) {
    const button = document.createElement("button");
    button.className = "head-toggle";
    button.dataset.head = h;
    button.textContent = h;
    button.title = "show or hide head " + h;
    button.style.setProperty("--head-colour", headColour(h));
    button.addEventListener("click", () => {
      if (state.heads.has(h)) state.heads.delete(h); else state.heads.add(h);
      syncToggles();
      drawLines();
    });
    toggles.appendChild(button);
    toggleButtons.push(button);
  }
  function syncToggles() {
    toggleButtons.forEach((b, h) => b.setAttribute("aria-pressed", state.heads.has(h) ? "true" : "false"));
  }
  document.getElementById("heads-all").addEventListener("click", () => {
    for (let h = 0; h < NH; h++) state.heads.add(h);
    syncToggles(); drawLines();
  });
  document.getElementById("heads-none").addEventListener("click", () => {
    state.heads.clear(); syncToggles(); drawLines();
  });
  const relative = document.getElementById("relative-scale");
  relative.checked = state.relative;
  relative.addEventListener("change", () => { state.relative = relative.checked; drawLines(); });
  syncToggles();
  drawLines();

  // ------------------------------------------------------------------ model view
  const scratch = document.createElement("canvas");
  scratch.width = S;
  scratch.height = L;
  const scratchCtx = scratch.getContext("2d");
  function paintMap(l, h) { // one pixel per cell into the scratch canvas, viridis from 0 to the map's max
    const image = scratchCtx.createImageData(S, L);
    const px = image.data, peak = mapMax[l][h] > 0 ? mapMax[l][h] : 1;
    const base = (l * NH + h) * L * S;
    for (let k = 0; k < L * S; k++) {
      const c = Math.max(0, Math.min(255, Math.round((W[base + k] / peak) * 255))) * 3;
      px[4 * k] = LUT[c]; px[4 * k + 1] = LUT[c + 1]; px[4 * k + 2] = LUT[c + 2]; px[4 * k + 3] = 255;
    }
    scratchCtx.putImageData(image, 0, 0);
    return scratch;
  }

  const grid = document.getElementById("model-grid");
  const thumb = Math.max(40, Math.min(96, Math.floor(880 / NH)));
  const thumbW = S >= L ? thumb : Math.max(8, Math.round(thumb * S / L));
  const thumbH = L >= S ? thumb : Math.max(8, Math.round(thumb * L / S));
  grid.style.gridTemplateColumns = "auto repeat(" + NH + ", " + thumbW + "px)";
  let modelDrawn = false;
  function drawModel() {
    if (modelDrawn) return;
    modelDrawn = true;
    grid.appendChild(document.createElement("span"));
    for (let h = 0; h < NH; h++) {
      const label = document.createElement("span");
      label.className = "grid-label";
      label.textContent = "head " + h;
      grid.appendChild(label);
    }
    for (let l = 0; l < NL; l++) {
      const label = document.createElement("span");
      label.className = "grid-label row";
      label.textContent = D.layerNames[l];
      grid.appendChild(label);
      for (let h = 0; h < NH; h++) {
        const canvas = document.createElement("canvas");
        canvas.className = "thumb";
        canvas.width = thumbW;
        canvas.height = thumbH;
        canvas.dataset.layer = l;
        canvas.dataset.head = h;
        canvas.dataset.max = mapMax[l][h];
        canvas.title = D.layerNames[l] + ", head " + h + " (largest weight " + mapMax[l][h].toFixed(3) + ")";
        const ctx = canvas.getContext("2d");
        ctx.imageSmoothingEnabled = S > thumbW; // average when shrinking, crisp cells when enlarging
        ctx.drawImage(paintMap(l, h), 0, 0, thumbW, thumbH);
        canvas.addEventListener("click", () => openDetail(l, h));
        grid.appendChild(canvas);
      }
    }
    document.body.dataset.modelReady = "1";
  }

  const detail = document.getElementById("detail");
  const detailCanvas = document.getElementById("detail-canvas");
  const detailInfo = document.getElementById("detail-info");
  let geometry = null;
  function labelStep(cell) { return Math.max(1, Math.ceil(13 / cell)); }
  function openDetail(l, h) {
    state.detail = { layer: l, head: h };
    document.querySelectorAll("canvas.thumb").forEach((c) => {
      c.classList.toggle("active", Number(c.dataset.layer) === l && Number(c.dataset.head) === h);
    });
    detail.hidden = false;
    document.getElementById("detail-title").textContent = D.layerNames[l] + ", head " + h;
    const cell = Math.max(2, Math.min(40, Math.floor(640 / big))); // >= 2 px: hoverable
    const step = labelStep(cell);
    const ctx0 = detailCanvas.getContext("2d");
    ctx0.font = "12px sans-serif";
    let qLab = 0, kLab = 0;
    D.queryTokens.forEach((t, i) => { if (i % step === 0) qLab = Math.max(qLab, ctx0.measureText(shown(t)).width); });
    D.keyTokens.forEach((t, j) => { if (j % step === 0) kLab = Math.max(kLab, ctx0.measureText(shown(t)).width); });
    const left = Math.min(150, Math.ceil(qLab) + 10), topM = Math.min(150, Math.ceil(kLab) + 10);
    const width = left + S * cell + 8, height = topM + L * cell + 8;
    const dpr = window.devicePixelRatio || 1;
    detailCanvas.width = Math.round(width * dpr);
    detailCanvas.height = Math.round(height * dpr);
    detailCanvas.style.width = width + "px";
    detailCanvas.style.height = height + "px";
    const ctx = detailCanvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, width, height);
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(paintMap(l, h), left, topM, S * cell, L * cell);
    ctx.fillStyle = "#222";
    ctx.font = "12px sans-serif";
    ctx.textBaseline = "middle";
    ctx.textAlign = "right";
    D.queryTokens.forEach((t, i) => {
      if (i % step === 0) ctx.fillText(shown(t), left - 4, topM + (i + 0.5) * cell, left - 6);
    });
    ctx.save();
    ctx.rotate(-Math.PI / 2);
    ctx.textAlign = "left";
    D.keyTokens.forEach((t, j) => {
      if (j % step === 0) ctx.fillText(shown(t), -(topM - 4), left + (j + 0.5) * cell, topM - 6);
    });
    ctx.restore();
    if (cell >= 34) { // room for the numbers, as in the static pictures
      ctx.textAlign = "center";
      ctx.font = "11px sans-serif";
      for (let i = 0; i < L; i++) {
        for (let j = 0; j < S; j++) {
          const w = weight(l, h, i, j);
          ctx.fillStyle = w > 0.6 * mapMax[l][h] ? "#000" : "#fff";
          ctx.fillText(w.toFixed(2), left + (j + 0.5) * cell, topM + (i + 0.5) * cell);
        }
      }
    }
    geometry = { left: left, top: topM, cell: cell };
    Object.assign(detailCanvas.dataset, {
      layer: l, head: h, left: left, top: topM, cell: cell, dpr: dpr, max: mapMax[l][h],
    });
    detailInfo.innerHTML = "&nbsp;";
    delete detailInfo.dataset.weight;
    detail.scrollIntoView({ block: "nearest" });
  }
  detailCanvas.addEventListener("mousemove", (event) => {
    if (!geometry || !state.detail) return;
    const rect = detailCanvas.getBoundingClientRect();
    const x = event.clientX - rect.left - geometry.left, y = event.clientY - rect.top - geometry.top;
    const i = Math.floor(y / geometry.cell), j = Math.floor(x / geometry.cell);
    if (x < 0 || y < 0 || i >= L || j >= S) return;
    const w = weight(state.detail.layer, state.detail.head, i, j);
    detailInfo.textContent = "query " + i + " \u201c" + shown(D.queryTokens[i]) + "\u201d \u2192 key " +
      j + " \u201c" + shown(D.keyTokens[j]) + "\u201d: weight " + fmt(w);
    Object.assign(detailInfo.dataset, { query: i, key: j, weight: w });
  });

  // ------------------------------------------------------------------ tabs and the test hook
  document.querySelectorAll("nav.tabs button").forEach((tab) => {
    tab.addEventListener("click", () => {
      document.querySelectorAll("nav.tabs button").forEach((t) => {
        t.setAttribute("aria-selected", t === tab ? "true" : "false");
        document.getElementById(t.dataset.view).hidden = t !== tab;
      });
      if (tab.dataset.view === "model-view") drawModel();
    });
  });

  window.attnExplorer = {
    layers: NL, heads: NH, L: L, S: S, encoding: D.encoding, state: state, weight: weight,
    mapMax: mapMax, headColour: headColour,
  };
  document.body.dataset.ready = "1";
})();
