"""The grading bench (`disagg bench grading`): the class replay (replay), its command (command), the cost model
(predict) on its rates (rates) with the one-machine term (cpu), and the timeline PNG (plot). May import
backends.decode's budget, backends.site's second gateway and kv_bridge's root; never a node's engine."""
