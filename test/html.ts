// Reading Latch's pages in tests that have no browser: the text of an escaped attribute or element.

/** Undoes `escapeHtml`, and the numeric references Latch writes. */
export function unescapeHtml(text: string): string {
  return text
    .replace(/&#(\d+);/g, (_, code: string) => String.fromCharCode(Number(code)))
    .replace(/&quot;/g, '"')
    .replace(/&lt;/g, '<')
    .replace(/&gt;/g, '>')
    .replace(/&amp;/g, '&')
}

/** What an error page says, without the page around it. */
export function pageError(html: string): string {
  const error = /<p class="error">([\s\S]*?)<\/p>/.exec(html)?.[1]
  return error === undefined ? html.slice(0, 300) : unescapeHtml(error)
}
