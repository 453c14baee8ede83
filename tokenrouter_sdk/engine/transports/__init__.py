"""The transports room: how messages move between the engine and its sub-servers. Threads
(`transport`), processes through one pyzmq hub (`hub`, `process_transport`, `process_child`,
`process_start`, `codec`, `wire`, `cores`, `fd_limit`), Ray actors (`ray_transport`) and simulated
time (`sim_transport`)."""
