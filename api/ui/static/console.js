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

  // --- the job page: sections re-rendered by the server, partial outputs as they stream ---
  var liveHandlers = {
    // A text delta: {data: {stage, output, text, index, attempt}}; appended to one <pre> per output.
    // A stage that runs again (its worker was lost) streams its text again from index 0, with the
    // next attempt number: the <pre> then starts over instead of showing the text twice.
    "output.delta": function (ev, box) {
      var d = ev.data || {};
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
      document.title = document.title.replace(/^\[[a-z]+\] /, "");
      if (!payload.final) document.title = "[" + payload.status + "] " + document.title;
    });
    Object.keys(liveHandlers).forEach(function (type) {
      source.addEventListener(type, function (msg) {
        var box = document.querySelector("[data-live-outputs]");
        if (!box) return;
        document.getElementById("job-live").hidden = false;
        liveHandlers[type](JSON.parse(msg.data), box);
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
    var job = document.querySelector("[data-job-stream]");
    if (job) followJob(job);
    var list = document.querySelector("[data-list-stream]");
    if (list) followList(list);
  });
})();
