// A conversation in the prompt box, for a model with a chat template (GET /models lists "chat"
// in its tasks): role-tagged turns. A line "user: …" (or system, developer, assistant) begins a
// turn; the lines after it, up to the next tag, continue it. The server renders the turns with
// the model's own template, so the attention views show the template's tokens.

import { ApiError } from "./api.js";

const TAG = /^(system|developer|user|assistant):[ \t]?/;

export const EXAMPLE_CONVERSATION = "system: You are brief.\nuser: Who is Romeo?";

/** Whether the prompt box holds a conversation: the toggle is on and the model has a template. */
export function chatMode(state) {
  return !!(state.chat && state.meta?.tasks.includes("chat"));
}

/** The box's text as OpenAI's messages: [{role, content}, …]; an ApiError says what is wrong. */
export function parseConversation(text) {
  const messages = [];
  for (const line of text.split("\n")) {
    const tag = line.match(TAG);
    if (tag) messages.push({ role: tag[1], content: line.slice(tag[0].length) });
    else if (messages.length) messages[messages.length - 1].content += "\n" + line;
    else if (line.trim()) {
      throw new ApiError(`A conversation is turns, each beginning with its role ("user: …", "assistant: …", "system: …"); the first line is "${line.slice(0, 40)}".`, { fields: ["messages"] });
    }
  }
  for (const m of messages) m.content = m.content.replace(/\s+$/, "");
  if (!messages.length) throw new ApiError('Type a conversation: a line beginning "user: " and what the user says.', { fields: ["messages"] });
  return messages;
}

/** Plain text as a conversation: it becomes the user's turn (a conversation stays as it is). */
export function asConversation(text) {
  const t = text.trim();
  if (!t) return EXAMPLE_CONVERSATION;
  return TAG.test(t) ? text : `user: ${t}`;
}
