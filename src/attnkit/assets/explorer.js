/* attnkit attention explorer: head view (SVG lines) and model view (canvas heatmaps).
 * Self-contained, no dependencies. Reads the weights embedded in <script id="attn-data">: one
 * entry per input (the page may hold several held-out inputs of one model, chosen by a selector).
 * Layout of an input's weights: layer-major, then head, query (row), key (column).
 * Everything drawn carries its weight in data attributes so that tests can check it.
 *
 * Parts: LAYOUT (the sizes), decodeInput (base64 -> weights), colours, createHeadView,
 * createModelView, createInputChooser, initTabs; main() at the bottom wires them together. */
(function () {
  "use strict";

  // ------------------------------------------------------------------ layout constants
  const LAYOUT = Object.freeze({
    // head view: token rows, columns, the lines between them
    rowPx: (tokens) => (tokens > 128 ? 12 : tokens > 48 ? 15 : 20), // height of one token row
    fontInsetPx: 6, // token font = row height - inset ...
    minFontPx: 9, // ... but never smaller
    columnTitlePx: 12, // "query (attends)" / "key (attended to)"
    columnTitleY: 14,
    columnPadPx: 12, // room around a token's label
    columnMaxPx: 200, // longer labels are cut by the SVG
    linesGapPx: (tokens) => (tokens > 128 ? 360 : 280), // horizontal run of the lines
    edgePx: 8, // outer padding of the SVG
    topPx: 24, // room for the column titles
    tokenGapPx: 4, // between a column and the lines
    labelInsetPx: 6, // text inset inside a token's box
    headFanRows: 0.5, // the heads' lines fan out over this fraction of a row
    lineWidthPx: [0.6, 3.4], // width = a + b * opacity
    hiddenOpacity: 0.01, // lines fainter than this are not drawn (512-token views stay light)
    overview: { maxLines: 4096, minWeight: 0.02, opacity: 0.35 }, // faint lines with nothing hovered
    relativeFromKeys: 24, // more keys than this: lines scaled to the largest weight by default
    // model view: thumbnails and the large map
    thumbPx: [40, 96], // smallest and largest thumbnail side
    gridWidthPx: 880, // thumbnails of one layer share this width
    thumbMinSidePx: 8, // the short side of a non-square map
    detailWidthPx: 640, // the large map's cells fill about this width
    cellPx: [2, 40], // smallest (still hoverable) and largest cell
    detailLabelPx: 13, // a label every ceil(13 / cell) rows
    detailFont: "12px sans-serif",
    detailMarginMaxPx: 150,
    numbersFromCellPx: 34, // cells this large also print their weight
  });
  const SVG_NS = "http://www.w3.org/2000/svg";
  const Q_TITLE = "query (attends)", K_TITLE = "key (attended to)";

  // ------------------------------------------------------------------ decoding the weights
  function base64Bytes(text) {
    const bin = atob(text);
    const out = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
    return out;
  }

  let halfValues = null;
  function halfTable() { // every IEEE binary16 bit pattern -> its value (subnormals included)
    if (halfValues) return halfValues;
    halfValues = new Float32Array(65536);
    for (let h = 0; h < 65536; h++) {
      const sign = h & 0x8000 ? -1 : 1, exp = (h >> 10) & 0x1f, frac = h & 0x3ff;
      if (exp === 0) halfValues[h] = sign * frac * Math.pow(2, -24);
      else if (exp === 31) halfValues[h] = frac ? NaN : sign * Infinity;
      else halfValues[h] = sign * (1 + frac / 1024) * Math.pow(2, exp - 15);
    }
    return halfValues;
  }

  /** One input's weights: {L, S, queryTokens, keyTokens, label, note, weight(l, h, i, j), W, mapMax}. */
  function decodeInput(D, input) {
    const NL = D.layers, NH = D.heads, L = input.L, S = input.S;
    const bytes = base64Bytes(input.data);
    const n = NL * NH * L * S;
    const W = new Float32Array(n);
    if (D.encoding === "float16") {
      const half = new Uint16Array(bytes.buffer, 0, n); // little-endian, as written by attnkit
      const table = halfTable();
      for (let i = 0; i < n; i++) W[i] = table[half[i]];
    } else {
      const size = L * S;
      for (let m = 0; m < NL * NH; m++) {
        const scale = input.scales[Math.floor(m / NH)][m % NH] / 255;
        for (let i = m * size; i < (m + 1) * size; i++) W[i] = bytes[i] * scale;
      }
    }
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
    return {
      L: L, S: S, queryTokens: input.queryTokens, keyTokens: input.keyTokens,
      label: input.label, note: input.note, W: W, mapMax: mapMax,
      weight: (l, h, i, j) => W[((l * NH + h) * L + i) * S + j],
    };
  }

  // ------------------------------------------------------------------ colours and labels
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
  const LUT = new Uint8Array(256 * 3); // viridis, 256 steps
  for (let k = 0; k < 256; k++) {
    const x = (k / 255) * (VIRIDIS.length - 1), a = Math.min(Math.floor(x), VIRIDIS.length - 2);
    const t = x - a;
    for (let c = 0; c < 3; c++) LUT[k * 3 + c] = Math.round(VIRIDIS[a][c] * (1 - t) + VIRIDIS[a + 1][c] * t);
  }

  function shown(token) { // empty tokens, newlines and edge spaces made visible
    if (token === "") return "\u2205";
    return token.replace(/\n/g, "\u21b5").replace(/^ +| +$/g, (m) => "\u2423".repeat(m.length));
  }
  function fmt(w) { return w.toFixed(4); }

  function svgEl(name, attrs, parent) {
    const node = document.createElementNS(SVG_NS, name);
    for (const key in attrs) node.setAttribute(key, attrs[key]);
    if (parent) parent.appendChild(node);
    return node;
  }

  // ------------------------------------------------------------------ head view
  /** Tokens in two columns joined by one line per head; hover, pin, layer and head controls. */
  function createHeadView(D, state, current) {
    const svg = document.getElementById("head-svg");
    const selectionInfo = document.getElementById("selection-info");
    const measure = document.createElement("canvas").getContext("2d");
    let geo = null, linesGroup = null, tokenNodes = { q: [], k: [] };

    function layout(input) { // the geometry of one input's columns
      const big = Math.max(input.L, input.S);
      const rowH = LAYOUT.rowPx(big);
      const fontPx = Math.max(LAYOUT.minFontPx, rowH - LAYOUT.fontInsetPx);
      measure.font = fontPx + "px sans-serif";
      const columnWidth = (tokens, title) => {
        let m = measure.measureText(title).width * LAYOUT.columnTitlePx / fontPx;
        for (const t of tokens) m = Math.max(m, measure.measureText(shown(t)).width);
        return Math.min(Math.ceil(m) + LAYOUT.columnPadPx, LAYOUT.columnMaxPx);
      };
      const qW = columnWidth(input.queryTokens, Q_TITLE), kW = columnWidth(input.keyTokens, K_TITLE);
      const xLineStart = LAYOUT.edgePx + qW + LAYOUT.tokenGapPx;
      const xLineEnd = xLineStart + LAYOUT.linesGapPx(big);
      return {
        big: big, rowH: rowH, fontPx: fontPx, qW: qW, kW: kW, xLineStart: xLineStart,
        xLineEnd: xLineEnd, xKeys: xLineEnd + LAYOUT.tokenGapPx,
        width: xLineEnd + LAYOUT.tokenGapPx + kW + LAYOUT.edgePx,
        height: LAYOUT.topPx + big * rowH + LAYOUT.edgePx,
      };
    }
    function rowY(index, count) { // centre the shorter column against the longer one
      return LAYOUT.topPx + (geo.big - count) * geo.rowH / 2 + index * geo.rowH + geo.rowH / 2;
    }

    function addTokens(side, tokens, x, width, anchor) {
      const group = svgEl("g", { id: side === "q" ? "query-tokens" : "key-tokens" }, svg);
      tokens.forEach((token, index) => {
        const y = rowY(index, tokens.length);
        const g = svgEl("g", { class: "token", "data-side": side, "data-index": index, tabindex: 0 }, group);
        svgEl("rect", { x: x, y: y - geo.rowH / 2 + 1, width: width, height: geo.rowH - 2, rx: 3 }, g);
        svgEl("text", {
          x: anchor === "end" ? x + width - LAYOUT.labelInsetPx : x + LAYOUT.labelInsetPx, y: y,
          "text-anchor": anchor, "dominant-baseline": "central", "font-size": geo.fontPx,
        }, g).textContent = shown(token);
        svgEl("title", {}, g).textContent = (side === "q" ? "query " : "key ") + index + ": " + token;
        g.addEventListener("mouseenter", () => { state.hover = { side: side, index: index }; draw(); });
        g.addEventListener("mouseleave", () => { state.hover = null; draw(); });
        g.addEventListener("click", () => {
          const same = state.pinned && state.pinned.side === side && state.pinned.index === index;
          state.pinned = same ? null : { side: side, index: index };
          draw();
        });
        g.addEventListener("keydown", (event) => {
          if (event.key === "Enter" || event.key === " ") { event.preventDefault(); g.dispatchEvent(new Event("click")); }
        });
        tokenNodes[side].push(g);
      });
    }

    /** Rebuild the columns for the current input (its tokens, its sizes). */
    function setInput() {
      const input = current();
      geo = layout(input);
      svg.textContent = "";
      svg.setAttribute("width", geo.width);
      svg.setAttribute("height", geo.height);
      svg.setAttribute("viewBox", "0 0 " + geo.width + " " + geo.height);
      svgEl("text", {
        x: LAYOUT.edgePx + geo.qW - LAYOUT.tokenGapPx, y: LAYOUT.columnTitleY, "text-anchor": "end",
        class: "column-title",
      }, svg).textContent = Q_TITLE;
      svgEl("text", { x: geo.xKeys + LAYOUT.tokenGapPx, y: LAYOUT.columnTitleY, class: "column-title" }, svg)
        .textContent = K_TITLE;
      linesGroup = svgEl("g", { id: "lines" }, svg);
      tokenNodes = { q: [], k: [] };
      addTokens("q", input.queryTokens, LAYOUT.edgePx, geo.qW, "end");
      addTokens("k", input.keyTokens, geo.xKeys, geo.kW, "start");
      draw();
    }

    function activeHeads() { return Array.from(state.heads).sort((a, b) => a - b); }
    function headOffset(h, heads) { // fan the heads out a little so that their lines stay apart
      if (heads.length < 2) return 0;
      return (heads.indexOf(h) / (heads.length - 1) - 0.5) * geo.rowH * LAYOUT.headFanRows;
    }
    function addLine(input, h, heads, i, j, w, opacity, cls) {
      const [base, gain] = LAYOUT.lineWidthPx;
      const line = svgEl("line", {
        x1: geo.xLineStart, y1: rowY(i, input.L) + headOffset(h, heads),
        x2: geo.xLineEnd, y2: rowY(j, input.S) + headOffset(h, heads),
        stroke: headColour(h), "stroke-opacity": opacity.toFixed(4),
        "stroke-width": (base + gain * opacity).toFixed(3), class: cls,
        "data-layer": state.layer, "data-head": h, "data-query": i, "data-key": j,
        "data-weight": w, "data-opacity": opacity,
      }, linesGroup);
      svgEl("title", {}, line).textContent = "head " + h + ": " + shown(input.queryTokens[i]) +
        " \u2192 " + shown(input.keyTokens[j]) + "  " + fmt(w);
    }

    function drawOverview(input, heads) { // nothing selected: a faint view of every line
      const o = LAYOUT.overview;
      if (input.L * input.S * heads.length > o.maxLines) return;
      for (const h of heads) {
        for (let i = 0; i < input.L; i++) {
          for (let j = 0; j < input.S; j++) {
            const w = input.weight(state.layer, h, i, j);
            if (w >= o.minWeight) addLine(input, h, heads, i, j, w, o.opacity * w, "overview");
          }
        }
      }
    }

    function drawSelection(input, heads, sel) { // one token's lines in every shown head
      const summary = [];
      const count = sel.side === "q" ? input.S : input.L;
      for (const h of heads) {
        const values = new Float32Array(count);
        let best = 0;
        for (let t = 0; t < count; t++) {
          values[t] = sel.side === "q" ? input.weight(state.layer, h, sel.index, t)
            : input.weight(state.layer, h, t, sel.index);
          if (values[t] > values[best]) best = t;
        }
        const peak = values[best] > 0 ? values[best] : 1;
        for (let t = 0; t < count; t++) {
          const w = values[t];
          const opacity = state.relative ? w / peak : w;
          if (opacity < LAYOUT.hiddenOpacity) continue;
          if (sel.side === "q") addLine(input, h, heads, sel.index, t, w, opacity, "focus");
          else addLine(input, h, heads, t, sel.index, w, opacity, "focus");
        }
        const other = sel.side === "q" ? input.keyTokens[best] : input.queryTokens[best];
        summary.push("head " + h + ": " + shown(other) + " (" + values[best].toFixed(2) + ")");
      }
      const token = sel.side === "q" ? input.queryTokens[sel.index] : input.keyTokens[sel.index];
      selectionInfo.textContent = (sel.side === "q" ? "Query " : "Key ") + sel.index + " \u201c" +
        shown(token) + "\u201d, " + D.layerNames[state.layer] + (sel.side === "q" ?
        " \u2014 attends most to: " : " \u2014 attended most by: ") + (summary.join("; ") || "no head selected");
    }

    function draw() {
      const input = current();
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
      if (sel) drawSelection(input, heads, sel);
      else { selectionInfo.textContent = ""; drawOverview(input, heads); }
    }

    function initControls() { // layer selector, one toggle per head, all/none, relative scale
      const layerSelect = document.getElementById("layer-select");
      D.layerNames.forEach((name, l) => {
        const option = document.createElement("option");
        option.value = l;
        option.textContent = name;
        layerSelect.appendChild(option);
      });
      layerSelect.value = String(state.layer);
      layerSelect.addEventListener("change", () => { state.layer = Number(layerSelect.value); draw(); });
      const toggles = document.getElementById("head-toggles");
      const buttons = [];
      const sync = () => buttons.forEach((b, h) => b.setAttribute("aria-pressed", state.heads.has(h) ? "true" : "false"));
      for (let h = 0; h < D.heads; h++) {
        const button = document.createElement("button");
        button.className = "head-toggle";
        button.dataset.head = h;
        button.textContent = h;
        button.title = "show or hide head " + h;
        button.style.setProperty("--head-colour", headColour(h));
        button.addEventListener("click", () => {
          if (state.heads.has(h)) state.heads.delete(h); else state.heads.add(h);
          sync(); draw();
        });
        toggles.appendChild(button);
        buttons.push(button);
      }
      document.getElementById("heads-all").addEventListener("click", () => {
        for (let h = 0; h < D.heads; h++) state.heads.add(h);
        sync(); draw();
      });
      document.getElementById("heads-none").addEventListener("click", () => {
        state.heads.clear(); sync(); draw();
      });
      const relative = document.getElementById("relative-scale");
      relative.checked = state.relative;
      relative.addEventListener("change", () => { state.relative = relative.checked; draw(); });
      sync();
    }

    initControls();
    return { setInput: setInput, draw: draw };
  }

  // ------------------------------------------------------------------ model view
  /** Every layer x head as a thumbnail; a click opens one map large with hoverable cells. */
  function createModelView(D, state, current) {
    const grid = document.getElementById("model-grid");
    const detail = document.getElementById("detail");
    const detailCanvas = document.getElementById("detail-canvas");
    const detailInfo = document.getElementById("detail-info");
    let scratch = null, drawn = false, visible = false, geometry = null;

    function paintMap(input, l, h) { // one pixel per cell, viridis from 0 to the map's max
      if (!scratch || scratch.width !== input.S || scratch.height !== input.L) {
        scratch = document.createElement("canvas");
        scratch.width = input.S;
        scratch.height = input.L;
      }
      const ctx = scratch.getContext("2d");
      const image = ctx.createImageData(input.S, input.L);
      const px = image.data, peak = input.mapMax[l][h] > 0 ? input.mapMax[l][h] : 1;
      const base = (l * D.heads + h) * input.L * input.S;
      for (let k = 0; k < input.L * input.S; k++) {
        const c = Math.max(0, Math.min(255, Math.round((input.W[base + k] / peak) * 255))) * 3;
        px[4 * k] = LUT[c]; px[4 * k + 1] = LUT[c + 1]; px[4 * k + 2] = LUT[c + 2]; px[4 * k + 3] = 255;
      }
      ctx.putImageData(image, 0, 0);
      return scratch;
    }

    function gridLabel(text, cls) {
      const label = document.createElement("span");
      label.className = cls;
      label.textContent = text;
      grid.appendChild(label);
    }

    function drawGrid() {
      const input = current();
      const [smallest, largest] = LAYOUT.thumbPx;
      const thumb = Math.max(smallest, Math.min(largest, Math.floor(LAYOUT.gridWidthPx / D.heads)));
      const thumbW = input.S >= input.L ? thumb : Math.max(LAYOUT.thumbMinSidePx, Math.round(thumb * input.S / input.L));
      const thumbH = input.L >= input.S ? thumb : Math.max(LAYOUT.thumbMinSidePx, Math.round(thumb * input.L / input.S));
      grid.textContent = "";
      grid.style.gridTemplateColumns = "auto repeat(" + D.heads + ", " + thumbW + "px)";
      grid.appendChild(document.createElement("span"));
      for (let h = 0; h < D.heads; h++) gridLabel("head " + h, "grid-label");
      for (let l = 0; l < D.layers; l++) {
        gridLabel(D.layerNames[l], "grid-label row");
        for (let h = 0; h < D.heads; h++) {
          const canvas = document.createElement("canvas");
          canvas.className = "thumb";
          canvas.width = thumbW;
          canvas.height = thumbH;
          canvas.dataset.layer = l;
          canvas.dataset.head = h;
          canvas.dataset.max = input.mapMax[l][h];
          canvas.title = D.layerNames[l] + ", head " + h + " (largest weight " + input.mapMax[l][h].toFixed(3) + ")";
          const ctx = canvas.getContext("2d");
          ctx.imageSmoothingEnabled = input.S > thumbW; // average when shrinking, crisp cells when enlarging
          ctx.drawImage(paintMap(input, l, h), 0, 0, thumbW, thumbH);
          canvas.addEventListener("click", () => openDetail(l, h));
          grid.appendChild(canvas);
        }
      }
      drawn = true;
      document.body.dataset.modelReady = "1";
    }

    function openDetail(l, h) {
      const input = current();
      state.detail = { layer: l, head: h };
      grid.querySelectorAll("canvas.thumb").forEach((c) => {
        c.classList.toggle("active", Number(c.dataset.layer) === l && Number(c.dataset.head) === h);
      });
      detail.hidden = false;
      document.getElementById("detail-title").textContent = D.layerNames[l] + ", head " + h;
      const [cellMin, cellMax] = LAYOUT.cellPx;
      const cell = Math.max(cellMin, Math.min(cellMax, Math.floor(LAYOUT.detailWidthPx / Math.max(input.L, input.S))));
      const step = Math.max(1, Math.ceil(LAYOUT.detailLabelPx / cell));
      const ctx0 = detailCanvas.getContext("2d");
      ctx0.font = LAYOUT.detailFont;
      let qLab = 0, kLab = 0;
      input.queryTokens.forEach((t, i) => { if (i % step === 0) qLab = Math.max(qLab, ctx0.measureText(shown(t)).width); });
      input.keyTokens.forEach((t, j) => { if (j % step === 0) kLab = Math.max(kLab, ctx0.measureText(shown(t)).width); });
      const left = Math.min(LAYOUT.detailMarginMaxPx, Math.ceil(qLab) + 10);
      const top = Math.min(LAYOUT.detailMarginMaxPx, Math.ceil(kLab) + 10);
      const width = left + input.S * cell + 8, height = top + input.L * cell + 8;
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
      ctx.drawImage(paintMap(input, l, h), left, top, input.S * cell, input.L * cell);
      ctx.fillStyle = "#222";
      ctx.font = LAYOUT.detailFont;
      ctx.textBaseline = "middle";
      ctx.textAlign = "right";
      input.queryTokens.forEach((t, i) => {
        if (i % step === 0) ctx.fillText(shown(t), left - 4, top + (i + 0.5) * cell, left - 6);
      });
      ctx.save();
      ctx.rotate(-Math.PI / 2);
      ctx.textAlign = "left";
      input.keyTokens.forEach((t, j) => {
        if (j % step === 0) ctx.fillText(shown(t), -(top - 4), left + (j + 0.5) * cell, top - 6);
      });
      ctx.restore();
      if (cell >= LAYOUT.numbersFromCellPx) { // room for the numbers, as in the static pictures
        ctx.textAlign = "center";
        ctx.font = "11px sans-serif";
        for (let i = 0; i < input.L; i++) {
          for (let j = 0; j < input.S; j++) {
            const w = input.weight(l, h, i, j);
            ctx.fillStyle = w > 0.6 * input.mapMax[l][h] ? "#000" : "#fff";
            ctx.fillText(w.toFixed(2), left + (j + 0.5) * cell, top + (i + 0.5) * cell);
          }
        }
      }
      geometry = { left: left, top: top, cell: cell };
      Object.assign(detailCanvas.dataset, {
        layer: l, head: h, left: left, top: top, cell: cell, dpr: dpr, max: input.mapMax[l][h],
      });
      detailInfo.innerHTML = "&nbsp;";
      delete detailInfo.dataset.weight;
      detail.scrollIntoView({ block: "nearest" });
    }

    detailCanvas.addEventListener("mousemove", (event) => {
      if (!geometry || !state.detail) return;
      const input = current();
      const rect = detailCanvas.getBoundingClientRect();
      const x = event.clientX - rect.left - geometry.left, y = event.clientY - rect.top - geometry.top;
      const i = Math.floor(y / geometry.cell), j = Math.floor(x / geometry.cell);
      if (x < 0 || y < 0 || i >= input.L || j >= input.S) return;
      const w = input.weight(state.detail.layer, state.detail.head, i, j);
      detailInfo.textContent = "query " + i + " \u201c" + shown(input.queryTokens[i]) + "\u201d \u2192 key " +
        j + " \u201c" + shown(input.keyTokens[j]) + "\u201d: weight " + fmt(w);
      Object.assign(detailInfo.dataset, { query: i, key: j, weight: w });
    });

    function refresh() { // draw the grid (and the open map) of the current input, once
      if (drawn) return;
      drawGrid();
      if (state.detail) openDetail(state.detail.layer, state.detail.head);
    }
    return {
      setVisible: (on) => { visible = on; if (visible) refresh(); },
      setInput: () => { drawn = false; if (visible) refresh(); }, // hidden: redrawn when shown
    };
  }

  // ------------------------------------------------------------------ inputs and tabs
  /** The selector over the page's inputs (hidden when there is one); calls onChange(index). */
  function createInputChooser(D, state, onChange) {
    const select = document.getElementById("input-select");
    const note = document.getElementById("input-note");
    D.inputs.forEach((input, k) => {
      const option = document.createElement("option");
      option.value = k;
      option.textContent = input.label || "input " + k;
      select.appendChild(option);
    });
    const showNote = () => { note.textContent = D.inputs[state.input].note || ""; };
    select.value = String(state.input);
    select.addEventListener("change", () => { state.input = Number(select.value); showNote(); onChange(); });
    showNote();
  }

  function initTabs(modelView) {
    const tabs = document.querySelectorAll("nav.tabs button");
    tabs.forEach((tab) => {
      tab.addEventListener("click", () => {
        tabs.forEach((t) => {
          t.setAttribute("aria-selected", t === tab ? "true" : "false");
          document.getElementById(t.dataset.view).hidden = t !== tab;
        });
        modelView.setVisible(tab.dataset.view === "model-view");
      });
    });
  }

  // ------------------------------------------------------------------ main
  function main() {
    const D = JSON.parse(document.getElementById("attn-data").textContent);
    const decoded = D.inputs.map(() => null); // decoded on first use
    const state = {
      input: 0,
      layer: D.initialLayer || 0,
      heads: new Set(Array.from({ length: D.heads }, (_, h) => h)),
      hover: null, // {side: "q" | "k", index}
      pinned: null,
      relative: D.inputs[0].S > LAYOUT.relativeFromKeys,
      detail: null, // {layer, head}
    };
    function current() {
      if (!decoded[state.input]) decoded[state.input] = decodeInput(D, D.inputs[state.input]);
      return decoded[state.input];
    }
    // the test hook: what is drawn, readable from the page (tests compare it with the data)
    const hook = {
      layers: D.layers, heads: D.heads, inputs: D.inputs.length, encoding: D.encoding,
      state: state, headColour: headColour,
    };
    function exposeInput() {
      const input = current();
      Object.assign(hook, { input: state.input, L: input.L, S: input.S, weight: input.weight, mapMax: input.mapMax });
    }
    const headView = createHeadView(D, state, current);
    const modelView = createModelView(D, state, current);
    function inputChanged() {
      state.hover = null;
      state.pinned = null;
      exposeInput();
      headView.setInput();
      modelView.setInput();
    }
    hook.selectInput = (k) => {
      const select = document.getElementById("input-select");
      select.value = String(k);
      select.dispatchEvent(new Event("change"));
    };
    createInputChooser(D, state, inputChanged);
    exposeInput();
    headView.setInput();
    initTabs(modelView);
    window.attnExplorer = hook;
    document.body.dataset.ready = "1";
  }

  main();
})();
