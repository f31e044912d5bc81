// Server-sent events over a fetch() ReadableStream: EventSource cannot POST, this can.

/**
 * Give the page a turn (a click, a frame) before going on: a stream that arrives faster than
 * the page reads it would otherwise be read in one unbroken run of microtasks, and a Stop
 * pressed meanwhile would only be seen once everything already received had been handled.
 */
export function yieldToPage() {
  if (globalThis.scheduler?.yield) return globalThis.scheduler.yield();
  return new Promise((resolve) => {
    const ch = new MessageChannel();
    ch.port1.onmessage = () => resolve();
    ch.port2.postMessage(0);
  });
}

const SLICE_MS = 8; // at most this long without giving the page a turn

/**
 * Read an SSE response body and call onEvent({event, data}) for each complete event.
 * `data` is parsed as JSON when it looks like JSON. Resolves when the stream ends; stops
 * (rejecting with an AbortError) as soon as `signal` is aborted, even mid-chunk.
 */
export async function readSSE(response, onEvent, { signal = null } = {}) {
  const aborted = () => {
    if (signal?.aborted) throw new DOMException("the reader stopped", "AbortError");
  };
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  const flush = (block) => {
    let event = "message";
    const data = [];
    let id = null;
    for (const line of block.split("\n")) {
      if (!line || line.startsWith(":")) continue;
      const colon = line.indexOf(":");
      const field = colon === -1 ? line : line.slice(0, colon);
      let value = colon === -1 ? "" : line.slice(colon + 1);
      if (value.startsWith(" ")) value = value.slice(1);
      if (field === "event") event = value;
      else if (field === "data") data.push(value);
      else if (field === "id") id = value;
    }
    if (!data.length && event === "message") return;
    const text = data.join("\n");
    let parsed = text;
    if (text && (text[0] === "{" || text[0] === "[" || text[0] === '"')) {
      try {
        parsed = JSON.parse(text);
      } catch {
        parsed = text;
      }
    }
    onEvent({ event, data: parsed, id });
  };
  let slice = performance.now();
  try {
    for (;;) {
      const { value, done } = await reader.read();
      aborted();
      if (done) break;
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
      let cut;
      while ((cut = buffer.indexOf("\n\n")) !== -1) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        flush(block);
        if (performance.now() - slice > SLICE_MS) {
          await yieldToPage();
          aborted();
          slice = performance.now();
        }
      }
    }
  } catch (err) {
    reader.cancel().catch(() => {}); // closes the connection: the server cancels the generation
    throw err;
  }
  buffer += decoder.decode();
  if (buffer.trim()) flush(buffer.replace(/\r\n?/g, "\n"));
}
