// omni-jobs console: live updates over Server-Sent Events, progressive enhancement only.
// Every page works without this script; it follows the streams the server offers and swaps in
// the HTML the server rendered. No dependencies, no build step.
(function () {
  "use strict";

  // --- times: shown in the browser's own time zone (the server renders UTC) ---
  function localizeTimes(root) {
    var today = new Date().toDateString();
    (root || document).querySelectorAll("time[data-ts]").forEach(function (el) {
      var ts = parseFloat(el.getAttribute("data-ts"));
      if (!isFinite(ts)) return;
      var d = new Date(ts * 1000);
      el.title = d.toString();
      // Today: the time alone; another day: the date and time. The tooltip has it in full.
      el.textContent = d.toDateString() === today
        ? d.toLocaleTimeString(undefined, {hour: "2-digit", minute: "2-digit", second: "2-digit"})
        : d.toLocaleString(undefined, {month: "short", day: "numeric", hour: "2-digit", minute: "2-digit"});
    });
  }

  // --- small form conveniences ---
  function wireForms(root) {
    (root || document).querySelectorAll("select[data-autosubmit]").forEach(function (sel) {
      sel.addEventListener("change", function () { sel.form.submit(); });
    });
    (root || document).querySelectorAll("select[data-goto]").forEach(function (sel) {
      sel.addEventListener("change", function () { window.location.assign(sel.value); });
    });
    (root || document).querySelectorAll("form[data-confirm]").forEach(function (form) {
      if (form.dataset.wired) return;
      form.dataset.wired = "1";
      form.addEventListener("submit", function (ev) {
        if (!window.confirm(form.getAttribute("data-confirm"))) ev.preventDefault();
      });
    });
    (root || document).querySelectorAll("input[type=file][data-preview]").forEach(function (input) {
      input.addEventListener("change", function () {
        // The preview is an <img>, <audio> or <video>: it shows (or plays) a chosen file of its own kind.
        var preview = document.getElementById(input.getAttribute("data-preview"));
        var file = input.files && input.files[0];
        if (!preview) return;
        var kind = preview.tagName === "IMG" ? "image/" : preview.tagName.toLowerCase() + "/";
        if (preview.src && preview.src.indexOf("blob:") === 0) URL.revokeObjectURL(preview.src);
        if (file && file.type.indexOf(kind) === 0) {
          preview.src = URL.createObjectURL(file);
          preview.hidden = false;
        } else {
          preview.removeAttribute("src");
          preview.hidden = true;
        }
      });
    });
    var playground = document.getElementById("playground-form");
    if (playground && !playground.dataset.wired) {
      playground.dataset.wired = "1";
      playground.addEventListener("submit", function () {
        var button = document.getElementById("submit-job");
        if (button) { button.disabled = true; button.textContent = "Submitting…"; }
      });
    }
  }

  // --- streamed speech: audio output.delta events, played with the Web Audio API ---
  // A delta: {stage, output, attempt, start, sample_rate, format: "pcm_s16le", data: base64 PCM}. The rule
  // is omni_jobs.run.audio_stream.AudioDeltaReader's: a stage run again publishes its audio from sample 0, and
  // only the samples beyond those already received are new (a gap, trimmed from the replay, is skipped).
  var PCM_FORMAT = "pcm_s16le";
  var LEAD_S = 0.15;  // how far ahead the first chunk is scheduled: room for the next to arrive

  function isAudioDelta(d) { return d.format === PCM_FORMAT && typeof d.data === "string"; }

  function pcmToFloat(b64) {
    // 16-bit little-endian signed samples -> floats in [-1, 1] (the encoder scaled by 32767).
    var bin = atob(b64), n = bin.length >> 1, out = new Float32Array(n);
    for (var i = 0; i < n; i++) {
      var v = bin.charCodeAt(2 * i) | (bin.charCodeAt(2 * i + 1) << 8);
      out[i] = Math.max(-1, (v >= 0x8000 ? v - 0x10000 : v) / 32767);
    }
    return out;
  }

  function liveAudio(el) {
    var button = el.querySelector("#live-audio-toggle");
    var counter = el.querySelector("#live-audio-received");
    var status = el.querySelector("#live-audio-status");
    var state = {stage: el.getAttribute("data-stage") || null, output: el.getAttribute("data-output") || "audio",
                 chunks: [], received: 0, total: 0, rate: 24000, ctx: null, next: 0, scheduled: 0, ended: null};

    function setState(name, message) {
      el.setAttribute("data-state", name);
      button.setAttribute("aria-pressed", name === "playing" ? "true" : "false");
      button.textContent = name === "playing" ? "Stop" : "Listen live";
      if (message != null) status.textContent = message;
    }
    function seconds() { return state.total / state.rate; }
    function showCount() {
      counter.setAttribute("data-seconds", seconds().toFixed(3));
      counter.textContent = seconds().toFixed(1) + " s of speech received";
    }
    function schedule(samples) {
      var ctx = state.ctx;
      var buffer = ctx.createBuffer(1, samples.length, state.rate);  // resampled to the context's rate
      buffer.getChannelData(0).set(samples);
      var node = ctx.createBufferSource();
      node.buffer = buffer;
      node.connect(ctx.destination);
      // Back to back; a chunk that came late (the stream slower than real time) starts as soon as it can.
      var at = Math.max(state.next, ctx.currentTime + 0.02);
      node.start(at);
      state.next = at + buffer.duration;
      state.scheduled += samples.length;
      el.setAttribute("data-scheduled", (state.scheduled / state.rate).toFixed(3));
      node.onended = function () { if (state.ctx === ctx && state.ended && ctx.currentTime >= state.next - 0.01) finish(); };
    }
    function play() {
      var Context = window.AudioContext || window.webkitAudioContext;
      if (!Context) { status.textContent = "This browser cannot play streamed audio."; return; }
      state.ctx = new Context();
      state.next = state.ctx.currentTime + LEAD_S;
      state.scheduled = 0;
      state.chunks.forEach(schedule);  // what arrived so far, then each chunk as it comes
      setState("playing", "Playing" + (state.ended ? "" : " as it arrives") + ".");
      if (state.ended && !state.chunks.length) finish();
    }
    function stop(message) {
      if (state.ctx) { state.ctx.close(); state.ctx = null; }
      setState(state.ended === "succeeded" ? "done" : "idle", message);
      if (state.ended === "succeeded") button.hidden = true;
    }
    function finish() {
      stop(state.ended === "succeeded" ? "Played to the end; the stored clip is under Outputs."
                                       : "Played what was received.");
    }
    button.addEventListener("click", function () {
      if (state.ctx) stop("Stopped.");
      else play();
    });
    // The stored clip's own player takes over: playing it stops the live one.
    document.addEventListener("play", function (ev) {
      if (state.ctx && ev.target.tagName === "AUDIO") stop("Stopped: the stored clip is playing.");
    }, true);

    return {
      // One delta's data; true when it was audio of this player's (shown, never as text).
      feed: function (d) {
        if (d.output !== state.output || !isAudioDelta(d)) return false;
        if (!state.stage) state.stage = d.stage;
        if (d.stage !== state.stage) return true;
        var samples = pcmToFloat(d.data), start = typeof d.start === "number" ? d.start : state.received;
        var end = start + samples.length;
        if (end <= state.received) return true;  // a rerun's repeat of what was received
        var fresh = samples.subarray(Math.max(0, state.received - start));
        state.received = end;
        if (d.sample_rate) state.rate = d.sample_rate;
        state.chunks.push(fresh);
        state.total += fresh.length;
        el.hidden = false;
        showCount();
        if (state.ctx) schedule(fresh);
        return true;
      },
      // The job ended: a succeeded job's stored clip takes over (what is playing plays to its end).
      ended: function (status_) {
        if (state.ended) return;
        state.ended = status_;
        if (state.ctx) {
          if (state.ctx.currentTime >= state.next) finish();
          return;
        }
        if (status_ === "succeeded") {
          button.hidden = true;
          setState("done", state.total ? "Finished: the stored clip is under Outputs." : "");
        } else {
          setState("idle", "The job " + status_ + "; what was received can still be played.");
        }
      }
    };
  }
  var speech = null;  // the job page's live player (liveAudio), where it has one

  // --- the job page: sections re-rendered by the server, partial outputs as they stream ---
  var liveHandlers = {
    // A text delta: {data: {stage, output, text, index, attempt}}; appended to one <pre> per output.
    // A stage that runs again (its worker was lost) streams its text again from index 0, with the
    // next attempt number: the <pre> then starts over instead of showing the text twice.
    // Audio deltas go to the live player (never shown as text); the talker's speech codes (output
    // audio_codes) are the code2wav stage's input, not for people: not shown at all.
    "output.delta": function (ev, box) {
      var d = ev.data || {};
      if (d.codes != null || d.output === "audio_codes") return false;
      if (isAudioDelta(d)) return speech !== null && speech.feed(d);
      var key = (d.stage ? d.stage + "." : "") + (d.output || d.name || "text");
      var pre = box.querySelector('pre[data-live="' + CSS.escape(key) + '"]');
      if (!pre) {
        var fig = document.createElement("figure");
        fig.className = "output output-text";
        var cap = document.createElement("figcaption");
        cap.textContent = key + " (streaming)";
        pre = document.createElement("pre");
        pre.className = "text-output";
        pre.setAttribute("data-live", key);
        fig.appendChild(pre);
        fig.appendChild(cap);
        box.appendChild(fig);
      }
      var attempt = d.attempt != null ? String(d.attempt) : "";
      if (pre.getAttribute("data-attempt") !== attempt) {
        pre.textContent = "";
        pre.setAttribute("data-attempt", attempt);
      }
      pre.textContent += d.text != null ? d.text : (d.delta != null ? d.delta : "");
    },
    // A diffusion preview: {data: {output|stage, step, total, url | data (base64 PNG) | media_type}}.
    "output.preview": function (ev, box) {
      var d = ev.data || {};
      var key = d.output || d.name || d.stage || "preview";
      var src = null;
      if (typeof d.url === "string" && /^\/(?!\/)/.test(d.url)) src = d.url;  // this site's own paths only
      else if (typeof d.data === "string") src = "data:" + (d.media_type || "image/png") + ";base64," + d.data;
      if (!src) return;
      var img = box.querySelector('img[data-live="' + CSS.escape(key) + '"]');
      var cap;
      if (!img) {
        var fig = document.createElement("figure");
        fig.className = "output output-image";
        img = document.createElement("img");
        img.className = "pixelated";
        img.alt = key + " preview";
        img.setAttribute("data-live", key);
        cap = document.createElement("figcaption");
        fig.appendChild(img);
        fig.appendChild(cap);
        box.appendChild(fig);
      } else {
        cap = img.parentNode.querySelector("figcaption");
      }
      img.src = src;
      if (cap) cap.textContent = key + " preview" + (d.step != null ? " · step " + d.step + (d.total ? "/" + d.total : "") : "");
    }
  };
  // Other scripts (or a later version) may add handlers: window.omniConsole.on("output.delta", fn).
  window.omniConsole = {
    on: function (type, fn) { liveHandlers[type] = fn; }
  };

  function followJob(root) {
    var url = root.getAttribute("data-job-stream");
    if (!url || !window.EventSource) return;
    var last = {};
    var source = new EventSource(url);
    root.setAttribute("data-live", "connecting");
    source.addEventListener("open", function () { root.setAttribute("data-live", "open"); });
    source.addEventListener("sections", function (msg) {
      var payload = JSON.parse(msg.data);
      Object.keys(payload.sections).forEach(function (id) {
        var html = payload.sections[id];
        var el = document.getElementById(id);
        if (!el || last[id] === html) return;
        last[id] = html;
        // Keep playing media untouched: outputs never change once written, so re-render only if they differ.
        el.innerHTML = html;
        localizeTimes(el);
        wireForms(el);
      });
      root.setAttribute("data-status", payload.status);
      if (payload.final && speech) speech.ended(payload.status);
      document.title = document.title.replace(/^\[[a-z]+\] /, "");
      if (!payload.final) document.title = "[" + payload.status + "] " + document.title;
    });
    Object.keys(liveHandlers).forEach(function (type) {
      source.addEventListener(type, function (msg) {
        var box = document.querySelector("[data-live-outputs]");
        if (!box) return;
        // A handler answers false when it showed nothing (the section stays as it was).
        if (liveHandlers[type](JSON.parse(msg.data), box) !== false) document.getElementById("job-live").hidden = false;
      });
    });
    source.addEventListener("end", function () {
      source.close();
      root.setAttribute("data-live", "closed");
    });
    source.addEventListener("error", function () {
      // EventSource reconnects by itself (with Last-Event-ID); a closed stream stays closed.
      if (source.readyState === EventSource.CLOSED) root.setAttribute("data-live", "closed");
      else root.setAttribute("data-live", "reconnecting");
    });
  }

  // --- the jobs list: rows re-rendered by the server when they change ---
  function followList(table) {
    var url = table.getAttribute("data-list-stream");
    if (!url || !window.EventSource) return;
    var indicator = document.querySelector("[data-live-indicator]");
    var source = new EventSource(url);
    source.addEventListener("open", function () { if (indicator) indicator.hidden = false; });
    source.addEventListener("rows", function (msg) {
      var body = document.getElementById("job-rows");
      if (!body) return;
      var before = {};
      body.querySelectorAll("tr[data-job-id]").forEach(function (tr) { before[tr.getAttribute("data-job-id")] = 1; });
      body.innerHTML = JSON.parse(msg.data).html;
      body.querySelectorAll("tr[data-job-id]").forEach(function (tr) {
        if (!before[tr.getAttribute("data-job-id")]) tr.classList.add("fresh");
      });
      localizeTimes(body);
      table.setAttribute("data-updated", String(Date.now()));
    });
    source.addEventListener("signed-out", function () {
      source.close();
      window.location.assign("/ui/login?next=" + encodeURIComponent(window.location.pathname + window.location.search));
    });
    source.addEventListener("error", function () { if (indicator) indicator.hidden = true; });
  }

  document.addEventListener("DOMContentLoaded", function () {
    localizeTimes(document);
    wireForms(document);
    var player = document.querySelector("[data-live-audio]");
    if (player) speech = liveAudio(player);
    var job = document.querySelector("[data-job-stream]");
    if (job) followJob(job);
    var list = document.querySelector("[data-list-stream]");
    if (list) followList(list);
  });
})();
