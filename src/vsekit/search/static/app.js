"use strict";
// The page talks only to this server's /healthz, /search, /search/image (?target=images|captions) and /thumb/ID.
// Every piece of text from the index goes in through textContent, never as HTML.
const $ = (id) => document.getElementById(id);

function setStatus(text, isError = false) {
  const s = $("status");
  s.textContent = text;
  s.className = isError ? "error" : "muted";
}

function clearResults() {
  $("results").replaceChildren();
  $("captions").replaceChildren();
}

function pictureCard(hit, rank) {
  const li = document.createElement("li");
  li.className = "result";
  const fig = document.createElement("figure");
  const img = document.createElement("img");
  img.src = hit.thumb;
  img.alt = hit.caption || hit.path || `picture ${hit.id}`;
  img.loading = "lazy";
  const cap = document.createElement("figcaption");
  const text = document.createElement("span");
  text.className = "caption";
  text.textContent = hit.caption || hit.path;
  const score = document.createElement("span");
  score.className = "score";
  score.textContent = `#${rank} · ${hit.score.toFixed(3)}`;
  cap.append(text, score);
  fig.append(img, cap);
  li.append(fig);
  return li;
}

function captionRow(hit) {
  const li = document.createElement("li");
  li.className = "caption-result";
  const text = document.createElement("span");
  text.className = "caption";
  text.textContent = hit.caption;
  const score = document.createElement("span");
  score.className = "score";
  score.textContent = hit.score.toFixed(3);
  li.append(text, " ", score);
  return li;
}

async function readJson(resp) {
  try {
    return await resp.json();
  } catch {
    return { detail: `${resp.status} ${resp.statusText}` };
  }
}

async function searchText(q, k) {
  clearResults();
  setStatus("searching…");
  const params = new URLSearchParams({ q, k });
  let resp;
  try {
    resp = await fetch(`/search?${params}`);
  } catch (err) {
    setStatus(`the server did not answer (${err})`, true);
    return;
  }
  const body = await readJson(resp);
  if (!resp.ok) {
    setStatus(body.detail || `error ${resp.status}`, true);
    return;
  }
  body.results.forEach((hit, i) => $("results").append(pictureCard(hit, i + 1)));
  let msg = `${body.results.length} pictures in ${body.took_ms} ms`;
  if (body.unknown_words && body.unknown_words.length) {
    msg += ` · the model does not know: ${body.unknown_words.join(", ")}`;
  }
  setStatus(msg);
  history.replaceState(null, "", `?${params}`);
}

$("search-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const q = $("q").value.trim();
  if (!q) {
    setStatus("type a few words describing a picture", true);
    return;
  }
  searchText(q, $("k").value);
});

function showQueryPicture(file) {
  // a data: URL (the page's CSP allows 'self' and data: pictures only), read locally: nothing is uploaded here
  const preview = $("query-preview");
  const reader = new FileReader();
  reader.onload = () => {
    preview.src = reader.result;
    preview.alt = file.name;
    preview.hidden = false;
  };
  reader.readAsDataURL(file);
  $("drop-text").textContent = file.name;
}

async function searchPicture(file, target) {
  clearResults();
  setStatus(target === "images" ? "looking for similar pictures…" : "describing…");
  const params = new URLSearchParams({ k: $("k").value, target });
  let resp;
  try {
    resp = await fetch(`/search/image?${params}`, {
      method: "POST",
      headers: { "content-type": file.type || "application/octet-stream" },
      body: file,
    });
  } catch (err) {
    setStatus(`the server did not answer (${err})`, true);
    return;
  }
  const body = await readJson(resp);
  if (!resp.ok) {
    setStatus(body.detail || `error ${resp.status}`, true);
    return;
  }
  if (target === "images") {
    body.results.forEach((hit, i) => $("results").append(pictureCard(hit, i + 1)));
    setStatus(`${body.results.length} similar pictures in ${body.took_ms} ms`);
  } else {
    body.results.forEach((hit) => $("captions").append(captionRow(hit)));
    setStatus(`${body.results.length} captions in ${body.took_ms} ms`);
  }
}

function pictureTarget() {
  return document.querySelector("input[name=target]:checked").value;
}

$("image").addEventListener("change", () => {
  const file = $("image").files[0];
  if (file) showQueryPicture(file);
});

$("image-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const file = $("image").files[0];
  if (!file) {
    setStatus("choose or drop a picture first", true);
    return;
  }
  searchPicture(file, pictureTarget());
});

// drag and drop: a dropped picture becomes the chosen file and is searched at once
const drop = $("drop");
drop.addEventListener("dragover", (ev) => {
  ev.preventDefault();
  drop.classList.add("over");
});
drop.addEventListener("dragleave", () => drop.classList.remove("over"));
drop.addEventListener("drop", (ev) => {
  ev.preventDefault();
  drop.classList.remove("over");
  const file = ev.dataTransfer && ev.dataTransfer.files[0];
  if (!file) return;
  if (file.type && !file.type.startsWith("image/")) {
    setStatus(`${file.name} is not a picture`, true);
    return;
  }
  $("image").files = ev.dataTransfer.files;
  showQueryPicture(file);
  searchPicture(file, pictureTarget());
});

async function init() {
  try {
    const resp = await fetch("/healthz");
    const info = await resp.json();
    $("info").textContent =
      `${info.pictures} pictures · ${info.captions} captions · ${info.index} index · ${info.similarity} similarity`;
    $("q").maxLength = info.limits.max_query_chars;
    const kSel = $("k");
    for (const opt of [...kSel.options]) {
      if (Number(opt.value) > info.limits.max_k) opt.remove();
    }
  } catch {
    $("info").textContent = "the server did not answer /healthz";
  }
  const params = new URLSearchParams(location.search);
  const q = params.get("q");
  if (q) {
    $("q").value = q;
    if (params.get("k")) $("k").value = params.get("k");
    searchText(q.trim(), $("k").value);
  }
}

init();
