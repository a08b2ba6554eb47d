// Preloaded into the servers the bench measures (node --import tsx --import bench/probe.ts …):
// answers the bench's "usage" message over the IPC channel with this process's memory and the
// CPU time it has used so far. Nothing else.

process.on('message', (message) => {
  if (message !== 'usage') return
  const { rss, heapUsed } = process.memoryUsage()
  const { user, system } = process.cpuUsage()
  process.send?.({ rss, heapUsed, cpuMicros: user + system })
})
