// Server-sent events over a fetch() ReadableStream: EventSource cannot POST, this can.

/**
 * Read an SSE response body and call onEvent({event, data}) for each complete event.
 * `data` is parsed as JSON when it looks like JSON. Resolves when the stream ends.
 */
export async function readSSE(response, onEvent) {
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
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
    let cut;
    while ((cut = buffer.indexOf("\n\n")) !== -1) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      flush(block);
    }
  }
  buffer += decoder.decode();
  if (buffer.trim()) flush(buffer.replace(/\r\n?/g, "\n"));
}
