"""Plugins that put torch_p2p behind other frameworks' extension points. Each framework is
imported only inside its own subpackage; nothing else in torch_p2p imports a framework."""
