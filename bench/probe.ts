// Preloaded into the Latch process (node --import tsx --import bench/probe.ts server.ts): answers
// the bench's "memory" message over the IPC channel with this process's memory. Nothing else.

process.on('message', (message) => {
  if (message !== 'memory') return
  const { rss, heapUsed } = process.memoryUsage()
  process.send?.({ rss, heapUsed })
})
