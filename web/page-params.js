// For Corolla's own pages (not for embedding): copies the URL's `bootstrap`,
// `transport`, `server`, `system` and `adapter` query parameters onto the page's
// <corolla-chat id="chat">, e.g. /?transport=websocket (`adapter` takes the
// last value given; the others join theirs with spaces). A classic script
// placed after the element runs while the page is parsed, before any module
// script, so the element has the attributes when widget.js upgrades it.
(function () {
  var params = new URLSearchParams(location.search);
  var chat = document.getElementById('chat');
  if (!chat) return;
  ['bootstrap', 'transport', 'server', 'system', 'adapter'].forEach(function (name) {
    var values = params.getAll(name).filter(function (v) { return v.trim() !== ''; });
    if (name === 'adapter') values = values.slice(-1);
    if (values.length) chat.setAttribute(name, values.join(' '));
  });
})();
